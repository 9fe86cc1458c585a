"""Figures drawn from a run's own records (chapters 05, 07 and 10): what to record, and how to draw it.

Each recorder watches the code a chapter teaches without changing it (module hooks, a wrapped function), so
the figure shows what ran, not what the prose says should run:

- :func:`record_block_collectives`: which collectives the ledger booked inside which layer of a
  tensor-parallel block, forward and backward, in order (Megatron's ``f`` and ``g``, and sequence
  parallelism's all-gathers and reduce-scatters); :func:`draw_block_collectives` draws them.
- :func:`record_ring_blocks`: a fingerprint of the K/V block each rank holds at each step of ring attention;
  :func:`draw_ring_blocks` draws which rank's block that was.
- :func:`head_position_tags` and :func:`draw_ulysses`: which (head, position) pairs a rank holds before and
  after Ulysses' all-to-all, read from tags that travel through it.
- :func:`draw_mesh_groups`: the ranks of a mesh, and one rank's group along each dimension highlighted.

Plotting only imports matplotlib when called, so the ranks that record never load it.
"""

from __future__ import annotations

import contextlib

import torch

from helpers.parallel.ledger import LEDGER

KIND_COLORS = {"all_reduce": "tab:blue", "all_gather": "tab:orange", "reduce_scatter": "tab:green"}


# ------------------------------------------------------------------------------------------- f and g

def record_block_collectives(module: torch.nn.Module, run) -> list[tuple[str, str, str, list[str]]]:
    """Run ``run()`` (a forward and a backward through ``module``) with hooks on each of its layers that hold
    parameters; return, in the order they finished, ``(phase, layer name, layer class, collectives)``: the
    collectives (their names in the ledger) booked while that layer ran, forward or backward. Collectives
    booked outside every layer appear as a layer named ``"(between layers)"``."""
    events: list[tuple[str, str, str, list[str]]] = []
    mark = [len(LEDGER.messages)]
    open_layer: list = []

    def booked_since():
        new = [m.collective for m in LEDGER.messages[mark[0]:] if m.direction == "send"]
        mark[0] = len(LEDGER.messages)
        return new

    def enter(phase):
        def hook(*_):
            stray = booked_since()
            if stray:
                events.append((phase, "(between layers)", "", stray))
            open_layer.append(phase)
        return hook

    def leave(name, kind, phase):
        def hook(*_):
            open_layer.pop()
            events.append((phase, name, kind, booked_since()))
        return hook

    layers = [(n, m) for n, m in module.named_modules() if n and not list(m.children())
              and any(True for _ in m.parameters(recurse=False))]
    handles = []
    for name, layer in layers:
        kind = type(layer).__name__
        handles += [layer.register_forward_pre_hook(enter("forward")),
                    layer.register_forward_hook(leave(name, kind, "forward")),
                    layer.register_full_backward_pre_hook(enter("backward")),
                    layer.register_full_backward_hook(leave(name, kind, "backward"))]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    stray = booked_since()
    if stray:
        events.append(("backward", "(between layers)", "", stray))
    return events


def megatron_name(layer_class: str, collective: str, phase: str, sequence_parallel: bool) -> str:
    """Which of the paper's operators a collective booked inside a layer is: ``f`` before a column-parallel
    layer, ``g`` after a row-parallel one (with sequence parallelism, their all-gather and reduce-scatter
    forms, and backward the re-gather of a column-parallel layer's input)."""
    if layer_class == "ColumnParallelLinear":
        if sequence_parallel and phase == "backward" and collective == "all_gather":
            return "re-gather"
        return "f"
    if layer_class == "RowParallelLinear":
        return "g"
    return "?"


def draw_block_collectives(records: dict, short=lambda name: name):
    """``records``: ``{column title: (sequence_parallel, events of record_block_collectives for one phase)}``.
    One column per entry, the layers top to bottom in the order they finished, each collective booked inside a
    layer a coloured box under it. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    height = max(sum(1 + len(c) for *_, c in ev) for _, ev in records.values())
    fig, axes = plt.subplots(1, len(records), figsize=(2.3 * len(records), 0.42 * height + 0.8))
    for ax, (title, (sp, events)) in zip(axes, records.items()):
        y = 0
        for phase, name, kind, collectives in events:
            parallel = kind in ("ColumnParallelLinear", "RowParallelLinear")
            ax.add_patch(FancyBboxPatch((0.05, -y - 0.8), 0.9, 0.7, boxstyle="round,pad=0.02",
                                        fc="#dddddd" if parallel else "white", ec="0.4"))
            role = {"ColumnParallelLinear": " (column)", "RowParallelLinear": " (row)"}.get(kind, "")
            label = short(name) + role
            ax.text(0.5, -y - 0.45, label, ha="center", va="center", fontsize=8)
            y += 1
            for c in collectives:
                ax.add_patch(FancyBboxPatch((0.2, -y - 0.8), 0.6, 0.7, boxstyle="round,pad=0.02",
                                            fc=KIND_COLORS.get(c, "white"), ec="none"))
                ax.text(0.5, -y - 0.45, f"{megatron_name(kind, c, phase, sp)}: {c.replace('_', '-')}",
                        ha="center", va="center", fontsize=8, color="white")
                y += 1
        ax.set_xlim(0, 1)
        ax.set_ylim(-height - 0.2, 0.2)
        ax.set_title(title, fontsize=9)
        ax.axis("off")
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------ ring attention

@contextlib.contextmanager
def record_ring_blocks(context_parallel_module):
    """While inside, every forward ring step appends ``(step, fingerprint of the K/V block it computes on,
    the owner the code claims)`` to the yielded list. The fingerprint is the block's keys summed in fp64:
    a block that travelled unchanged keeps it exactly, so the kernel can match it to the rank that made it."""
    seen: list[tuple[int, float, int]] = []
    original = context_parallel_module.ring_step
    step = [0]

    def watched(q, kv, out, lse, layout, rank, owner, causal):
        seen.append((step[0], kv[0].double().sum().item(), owner))
        step[0] += 1
        return original(q, kv, out, lse, layout, rank, owner, causal)

    context_parallel_module.ring_step = watched
    try:
        yield seen
    finally:
        context_parallel_module.ring_step = original


def draw_ring_blocks(held: list[list[int]]):
    """``held[rank][step]``: whose K/V block that rank computed on at that step. A grid, rank by step, each
    cell coloured and labelled by the block's owner. Returns the figure."""
    import matplotlib.pyplot as plt

    n_ranks, n_steps = len(held), len(held[0])
    fig, ax = plt.subplots(figsize=(1.2 * n_steps + 1.8, 0.7 * n_ranks + 1.0))
    ax.imshow(held, cmap="tab10", vmin=0, vmax=9, alpha=0.55)
    for r in range(n_ranks):
        for s in range(n_steps):
            ax.text(s, r, f"K/V {held[r][s]}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(n_steps), [f"step {s}" for s in range(n_steps)], fontsize=9)
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)], fontsize=9)
    ax.set_title("whose keys and values each rank attends to, step by step", fontsize=10)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------ Ulysses

def head_position_tags(batch: int, n_heads: int, positions: torch.Tensor,
                       dtype=torch.float64) -> torch.Tensor:
    """A (batch, n_heads, len(positions), 2) tensor whose last dimension is (head, position): shaped like a
    rank's queries with a head size of 2, so it goes through the same all-to-all and says where it went."""
    heads = torch.arange(n_heads, dtype=dtype).view(1, -1, 1).expand(batch, n_heads, len(positions))
    pos = positions.to(dtype).view(1, 1, -1).expand(batch, n_heads, len(positions))
    return torch.stack([heads, pos], dim=-1)


def holdings(tags: torch.Tensor, n_heads: int, seq_len: int) -> torch.Tensor:
    """A (n_heads, seq_len) 0/1 map of the (head, position) pairs a tensor of tags holds."""
    held = torch.zeros(n_heads, seq_len, dtype=torch.int64)
    pairs = tags[0].reshape(-1, 2).long()
    held[pairs[:, 0], pairs[:, 1]] = 1
    return held


def draw_ulysses(before: list[torch.Tensor], after: list[torch.Tensor], shapes: list[tuple]):
    """``before[r]``, ``after[r]``: rank r's (head, position) map (:func:`holdings`) before and after the
    all-to-all; ``shapes[r]``: its tensor's shape before and after. Two panels, each cell coloured by the rank
    that holds it. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, maps, title, which in ((axes[0], before, "before: a slice of the sequence", 0),
                                   (axes[1], after, "after: a slice of the heads", 1)):
        owner = sum(r * m for r, m in enumerate(maps)).float()
        count = sum(maps)
        owner[count != 1] = float("nan")  # no cell is held twice, or by no one (checked on the page)
        ax.imshow(owner.numpy(), cmap="tab10", vmin=0, vmax=9, alpha=0.6, aspect="auto",
                  interpolation="nearest")
        ax.set_xlabel("position in the sequence", fontsize=9)
        ax.set_ylabel("query head", fontsize=9)
        shape = " · ".join(str(tuple(s[which])[1:3]).replace(" ", "") for s in shapes[:1])
        ax.set_title(f"{title}\n(each rank's (heads, positions): {shape})", fontsize=9)
        for r, m in enumerate(maps):
            ys, xs = m.nonzero(as_tuple=True)
            ax.text(xs.float().mean().item(), ys.float().mean().item(), f"rank {r}", ha="center", va="center",
                    fontsize=9, fontweight="bold")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------- mesh

def draw_mesh_groups(mesh, rank: int, names=None):
    """One panel per dimension of ``mesh`` (a :class:`helpers.parallel.mesh.Mesh`): every rank as a cell of a
    grid (the last two dimensions across, the others down), ``rank``'s group along that dimension filled, as
    ``mesh.rows`` gives it. Returns the figure."""
    import matplotlib.pyplot as plt

    names = names or mesh.names
    across = mesh.shape[-1] * (mesh.shape[-2] if len(mesh.shape) > 1 else 1)
    down = mesh.world_size // across
    fig, axes = plt.subplots(1, len(names), figsize=(1.9 * len(names), 0.32 * down + 1.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        group = next(row for row in mesh.rows(name) if rank in row)
        cells = torch.zeros(down, across)
        for r in group:
            cells[r // across, r % across] = 1
        cells[rank // across, rank % across] = 2
        ax.imshow(cells.numpy(), cmap="Blues", vmin=0, vmax=2.4)
        for r in range(mesh.world_size):
            ax.text(r % across, r // across, r, ha="center", va="center", fontsize=6,
                    color="white" if r == rank else "black")
        ax.set_title(f"{name}: {len(group)} ranks", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    return fig


__all__ = ["record_block_collectives", "megatron_name", "draw_block_collectives", "record_ring_blocks",
           "draw_ring_blocks", "head_position_tags", "holdings", "draw_ulysses", "draw_mesh_groups"]
