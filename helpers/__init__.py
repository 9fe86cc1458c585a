"""The book's code: the harness every chapter uses and what every chapter builds on, at this level;
``cost/`` (the cost model: chapter 01's calculator, the costs of collectives, pipeline schedules, the layout
search), ``parallel/`` (what talks between ranks, chapters 02-08), ``training/`` (chapters 09 and 11-15) and
``tools/`` (what only ``make`` runs) below it.

:data:`CHAPTERS` is the chapter -> module index (d2l's "defined in" back-link): for each published chapter,
the modules whose code it teaches, with ``show_source`` on its page. Each of those modules names its chapter
in its docstring ("(chapter 05)"). :data:`HARNESS` lists the modules every chapter uses and no one chapter
teaches. A new chapter's modules go to ``training/`` (chapters 09 and 11-15) or to ``parallel/`` (chapter 10,
which combines the parallelisms of 03-08), and into this index when the chapter joins ``_toc.yml``;
``tests/test_layout.py`` fails when a chapter, a module or its docstring's chapter is missing here, or when a
module file is in neither list.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, defined here only

# chapter number -> the modules it teaches, dotted names, in the order the chapter shows them
CHAPTERS = {
    "00": (),  # the harness itself, at work: ranks, dist, checks, tools.px_script
    "01": ("helpers.cost.model_size", "helpers.cost.budget_types", "helpers.cost.memory_budget",
           "helpers.cost.time_model", "helpers.layout_rules", "helpers.cost.matmul_rate",
           "helpers.cost.published_runs", "helpers.cost.calculator", "helpers.cost.calculator_presets"),
    "02": ("helpers.parallel.ledger", "helpers.parallel.collectives", "helpers.cost.collective_costs",
           "helpers.parallel.comms"),
    "03": ("helpers.parallel.data_parallel",),
    "04": ("helpers.parallel.zero",),
    "05": ("helpers.parallel.tensor_parallel_comms", "helpers.parallel.tensor_parallel_layers",
           "helpers.parallel.tensor_parallel", "helpers.parallel.tensor_parallel_torch"),
    "06": ("helpers.cost.pipeline_schedules", "helpers.parallel.pipeline_parallel",
           "helpers.parallel.pipeline_timeline"),
    "07": ("helpers.parallel.blockwise_attention", "helpers.parallel.context_parallel"),
    "08": ("helpers.parallel.moe", "helpers.parallel.expert_parallel"),
    "09": ("helpers.training.number_formats", "helpers.training.mixed_precision",
           "helpers.training.fp8_recipes", "helpers.training.fp8_gather",
           "helpers.training.fp8_training"),
    "10": ("helpers.parallel.mesh", "helpers.parallel.parallel_dims", "helpers.parallel.composition",
           "helpers.cost.layout_search"),
    "11": ("helpers.training.weight_sync", "helpers.training.rl_timing"),
    "12": ("helpers.training.optimizers", "helpers.training.distributed_muon"),
    "13": ("helpers.training.stability", "helpers.training.stability_run",
           "helpers.training.sharded_clipping", "helpers.training.mup"),
    "14": ("helpers.training.rl_objectives", "helpers.training.grpo"),
    "15": ("helpers.training.capstone", "helpers.training.capstone_checks",
           "helpers.training.capstone_faults", "helpers.training.capstone_bytes",
           "helpers.training.capstone_memory", "helpers.training.precision_bound",
           "helpers.training.checkpoint", "helpers.training.checkpoint_pieces",
           "helpers.training.checkpoint_run", "helpers.training.checkpoint_bytes"),
}

# what every chapter uses and none teaches: ranks, checks, what a page shows, the reference model and data
HARNESS = ("helpers.ranks", "helpers.forkserver", "helpers.dist", "helpers.checks", "helpers.errors",
           "helpers.exercises", "helpers.show", "helpers.measure", "helpers.model", "helpers.data",
           "helpers.reference", "helpers.janitor", "helpers.figures", "helpers.timing",
           "helpers.controller")
