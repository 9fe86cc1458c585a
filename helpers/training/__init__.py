"""The home of chapters 09 and 11-15 as they arrive: precision, weight sync, optimizers, stability, RL and the
capstone's trainer."""
