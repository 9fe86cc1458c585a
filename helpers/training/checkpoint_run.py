"""A capstone run stopped, saved and resumed (chapter 15), on every rank from a ``%%px`` cell or a test:
``helpers.training.capstone``'s run by the same loop, with a checkpoint (``helpers.training.checkpoint``)
written after one step, or read before the first.

- :func:`train_and_save` trains ``run.steps`` steps from the start and saves after step ``at``: the
  uninterrupted run, which also leaves the checkpoint behind;
- :func:`resume_run` builds the run (any layout of the same model), loads the checkpoint into its parameters
  and its optimizer, and trains on to ``run.steps``.

Both return what :func:`helpers.training.capstone.train` returns for the checks of
``helpers.training.capstone_checks`` (``losses`` and ``assembled`` take them as they are): the rank and where
it sits, every step's loss it trained (``None`` before the last stage), its parameters every ``run.every``
steps (and at the step it starts from, and the one saved after), and ``start``, the step its losses begin
after: a resumed run's ``capstone_checks.losses`` are steps ``start`` to ``run.steps`` (compare them with the
uninterrupted run's from ``start`` on), and ``capstone_checks.assembled`` takes the steps in ``params``.

From a ``%%px`` cell, on every rank (``path`` a folder every rank sees)::

    mesh = capstone.make_mesh(run)
    out = checkpoint_run.train_and_save(run, mesh, path, capstone.data(run), at=3)
    # ... and on another layout of the same model, ``other``:
    out = checkpoint_run.resume_run(other, capstone.make_mesh(other), path, capstone.data(other))
"""

from __future__ import annotations

import torch.distributed as dist

from helpers.parallel import composition
from helpers.parallel.mesh import MESH_ORDER, Mesh
from helpers.reference import train_steps
from helpers.training import capstone, checkpoint


def _built(run, mesh: Mesh):
    chunks = composition.apply(capstone.build(run).to(run.rank_device()), mesh, run)
    return chunks, capstone.optimizer(chunks, mesh, run)


def _train(run, mesh: Mesh, chunks, opt, batches_, start: int, stop: int, out: dict) -> None:
    """Steps ``start`` to ``stop`` (the parameters kept every ``run.every`` steps)."""
    device = run.rank_device()

    def step(x, y):
        return composition.forward_backward(chunks, mesh, run, x, y)[0]
    cuts = sorted({start, stop} | {s for s in range(start, stop + 1) if s % run.every == 0})
    for a, b in zip(cuts, cuts[1:]):
        out["losses"] += train_steps(None, [(x.to(device), y.to(device)) for x, y in batches_[a:b]],
                                     step=step, optimizer=opt)
        if b % run.every == 0 or b == run.steps:
            out["params"][b] = composition.params(chunks)


def _out(mesh: Mesh, chunks, start: int) -> dict:
    coordinates = mesh.coordinates(dist.get_rank())
    return {"rank": dist.get_rank(), "where": {name: coordinates.get(name, 0) for name in MESH_ORDER},
            "losses": [], "params": {start: composition.params(chunks)}, "start": start}


def train_and_save(run, mesh: Mesh, path, batches_, at: int) -> dict:
    """This rank's run of ``run.steps`` steps on the global batches ``batches_``, saving the checkpoint
    (parameters and optimizer) under ``path`` after step ``at``."""
    if not 0 < at < run.steps:
        raise ValueError(f"at={at}: the checkpoint is saved after a step of the run, 1..{run.steps - 1}")
    chunks, opt = _built(run, mesh)
    out = _out(mesh, chunks, 0)
    _train(run, mesh, chunks, opt, batches_, 0, at, out)
    checkpoint.save(chunks, mesh, run, at, path, opt)
    out["params"][at] = composition.params(chunks)
    _train(run, mesh, chunks, opt, batches_, at, run.steps, out)
    return out


def resume_run(run, mesh: Mesh, path, batches_) -> dict:
    """This rank's run resumed from the checkpoint at ``path`` (saved on any layout of the same model, after
    some step ``start``), trained on the global batches ``batches_[start:run.steps]``."""
    chunks, opt = _built(run, mesh)
    start = checkpoint.load(chunks, mesh, run, path, opt)
    out = _out(mesh, chunks, start)
    _train(run, mesh, chunks, opt, batches_, start, run.steps, out)
    return out


__all__ = ["train_and_save", "resume_run"]
