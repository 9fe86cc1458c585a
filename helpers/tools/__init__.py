"""What only ``make`` runs: the book build, one chapter's run, the torchrun export, the reaper, the janitor,
the Sphinx fixes and the browser test."""
