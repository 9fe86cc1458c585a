"""Pipeline parallelism from scratch (chapter 06): the book's GPT cut into chunks, and one executor for any
schedule.

- :func:`pipeline_chunk` is a slice of the one reference GPT: a copy keeping a run of its blocks, with the
  embeddings only on the first chunk and the final norm and LM head only on the last (the others ``None``),
  under the reference's parameter names; :func:`split_model` cuts a model into chunks of
  :func:`helpers.cost.pipeline_schedules.stage_layers`. A tied LM head becomes the last chunk's own copy
  of the embedding; :func:`embedding_group` and :func:`allreduce_embedding_grads` keep the two copies equal,
  as Megatron-LM's embedding group does (the first and the last stage sum their gradients).
- :func:`run_schedule` runs this rank's (the group's rank) actions of a
  :class:`helpers.cost.pipeline_schedules.Schedule`, one :class:`Executor` method per action: F, B or I,
  W. Activations travel forward and their gradients backward by the tagged messages of
  :mod:`helpers.parallel.comms`, counted in the ledger; sends are asynchronous and receives wait, so the rank
  works in the schedule's order. Each action becomes an :class:`helpers.parallel.pipeline_timeline.Event`,
  with the bytes its ``SavedActivations`` measures.
- :func:`backward_input` and :func:`backward_weight` split a chunk's backward in two for the zero-bubble
  schedules, as ``torch.distributed.pipelining`` does: the first computes the gradients of the activations
  only, keeping the gradient at the output of every layer with weights; the second computes the weights'
  gradients from those alone, one layer at a time, without walking the rest of the graph again.
- :func:`torch_pipeline` runs the same chunks under ``torch.distributed.pipelining``'s schedules.

The loss of a step is the mean over the ``m`` micro-batches of each one's mean loss, so each micro-batch's
backward starts from ``loss / m``: the gradients are then those of the whole batch, as one process computes
them.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge

from helpers import layout_rules
from helpers.dist import device
from helpers.model import GPT, GPTConfig, cross_entropy
from helpers.parallel import comms
from helpers.cost.pipeline_schedules import Action, Schedule, stage_layers, validate
from helpers.parallel.pipeline_timeline import Timeline


def check_layout(cfg: GPTConfig, n_chunks: int) -> None:
    """Raise a ValueError naming the broken constraint if ``cfg`` cannot be cut into ``n_chunks`` chunks."""
    layout_rules.pipeline_parallel(n_chunks, cfg.n_layers)


def pipeline_chunk(model: GPT, index: int, n_chunks: int) -> GPT:
    """Chunk ``index`` of ``n_chunks``: a copy of ``model`` with only that chunk's blocks; the embeddings stay
    on the first chunk, the final norm and the LM head on the last. Its forward maps token ids (first chunk)
    or activations to activations (or, on the last chunk, logits and with targets the loss). A tied LM head
    on the last chunk is that chunk's own copy of the token embedding, equal to it (see
    :func:`allreduce_embedding_grads`)."""
    check_layout(model.cfg, n_chunks)
    keep = stage_layers(model.cfg.n_layers, n_chunks)[index]
    try:
        chunk = copy.deepcopy(model)
    except TypeError as err:  # a layer holding a process group (tensor or expert parallelism)
        raise ValueError(f"pipeline_chunk copies the model ({err}): cut the chunks first, then apply tensor "
                         f"or expert parallelism to each") from None
    for name in list(chunk.blocks.keys()):
        if int(name) not in keep:
            del chunk.blocks[name]  # the others keep their names: blocks.5 stays blocks.5
    if index > 0:
        chunk.tok_emb = chunk.pos_emb = None
    if index < n_chunks - 1:
        chunk.ln_f = chunk.lm_head = None
    return chunk


def split_model(model: GPT, n_chunks: int) -> list[GPT]:
    """``model`` cut into ``n_chunks`` chunks along its depth."""
    return [pipeline_chunk(model, c, n_chunks) for c in range(n_chunks)]


# ---------------------------------------------------------------------------------------------------------
# Tied embeddings: Megatron-LM's embedding group
# ---------------------------------------------------------------------------------------------------------

_EMBEDDING_GROUPS: dict = {}  # global ranks: (the default group it was made in, the group)


def embedding_group(placement, group=None):
    """Megatron-LM's *embedding group*: the ranks (of ``group``) holding the first and the last chunk of a
    pipeline whose chunk ``c`` runs on rank ``placement[c]`` (a schedule's ``s.placement``). Every rank of
    ``group`` calls it, in the same order; a rank outside the pair gets ``None``, and so does every rank
    when one rank holds both chunks (its two copies are summed where they are). Made once per pair of
    ranks, with a barrier among the pair only (``use_local_synchronization``)."""
    pair = sorted({placement[0], placement[-1]})
    if len(pair) == 1:
        return None
    members = tuple(r if group is None else dist.get_global_rank(group, r) for r in pair)
    world = dist.group.WORLD
    if members not in _EMBEDDING_GROUPS or _EMBEDDING_GROUPS[members][0] is not world:
        made = dist.new_group(list(members), use_local_synchronization=True)
        _EMBEDDING_GROUPS[members] = (world, made)
    return _EMBEDDING_GROUPS[members][1] if dist.get_rank() in members else None


def tied_copies(chunks: dict[int, GPT]) -> list[nn.Parameter]:
    """The copies of a tied embedding this rank must sum: the first chunk's ``tok_emb.weight`` and the last
    chunk's ``lm_head.weight``, as far as they are here; none if untied, or if one chunk holds both (one
    weight, as in one process)."""
    if any(c.tok_emb is not None and c.lm_head is not None for c in chunks.values()):
        return []
    return [p for c in chunks.values() if c.cfg.tie_embeddings
            for p in ([] if c.tok_emb is None else [c.tok_emb.weight])
            + ([] if c.lm_head is None else [c.lm_head.weight])]


def _check_embedding_group(chunks: dict[int, GPT], group) -> None:
    if len(tied_copies(chunks)) == 1 and group is None:
        raise ValueError("tied embeddings: this rank holds one copy of the embedding (the first or the last "
                         "chunk's) and no embedding group to sum its gradient with the other's: pass "
                         "embedding_group=pipeline_parallel.embedding_group(s.placement, group)")


def allreduce_embedding_grads(chunks: dict[int, GPT], group) -> None:
    """After a step's backward, sum the gradients of the two copies of a tied embedding, so that both take
    the same optimizer step and stay equal: over ``group`` (:func:`embedding_group`) between the first and
    the last stage, or in place where this rank holds both, as Megatron-LM's
    ``_allreduce_word_embedding_grads`` does. The loss uses the weight twice, at the input and at the
    output; each stage sees one use, so each copy's gradient is one of the two terms of the whole."""
    _check_embedding_group(chunks, group)
    copies = tied_copies(chunks)
    if len(copies) == 2:  # the first and the last chunk on this rank
        total = copies[0].grad + copies[1].grad
        copies[0].grad, copies[1].grad = total, total.clone()
    elif copies:
        comms.all_reduce(copies[0].grad, group)


# ---------------------------------------------------------------------------------------------------------
# The executor
# ---------------------------------------------------------------------------------------------------------


def _tag(kind: str, chunk: int, micro_batch: int, m: int) -> int:
    """One tag per message: the activation leaving ``chunk`` (kind "F") or the gradient of its input
    ("grad")."""
    return 2 * (chunk * m + micro_batch) + (kind == "grad")


class _Mailbox:
    """One rank's point-to-point messages, through :mod:`helpers.parallel.comms`: asynchronous tagged sends
    and waited receives, each counted in the ledger with the bytes of the tensor it carries. Chunk ``c``'s
    activation goes to the rank of chunk ``c + 1``, the gradient of its input to that of ``c - 1``."""

    def __init__(self, s: Schedule, group, like: torch.Tensor, timeout_s: float | None):
        self.s, self.group, self.like, self.timeout_s = s, group, like, timeout_s
        self.rank = dist.get_rank(group)
        self.pending: list = []
        self.local: dict = {}  # messages between two chunks of the same rank need no network

    def send(self, tensor, kind: str, chunk: int, micro_batch: int, step: int) -> None:
        dst = self.s.placement[chunk + 1 if kind == "F" else chunk - 1]
        if dst == self.rank:
            self.local[(kind, chunk, micro_batch)] = tensor.detach()
            return
        self.pending.append(comms.send(tensor, dst, self.group, tag=_tag(kind, chunk, micro_batch, self.s.m),
                                       label="pipeline", phase=_PHASES[kind], step=step))

    def recv(self, kind: str, chunk: int, micro_batch: int, step: int) -> torch.Tensor:
        """The message of ``kind`` that chunk ``chunk`` sent for ``micro_batch``."""
        src = self.s.placement[chunk]
        if src == self.rank:
            return self.local.pop((kind, chunk, micro_batch))
        return comms.recv(self.like, src, self.group, tag=_tag(kind, chunk, micro_batch, self.s.m),
                          label="pipeline", phase=_PHASES[kind], step=step, timeout_s=self.timeout_s)

    def flush(self) -> None:
        for sent in self.pending:
            sent.wait()
        self.pending.clear()


_PHASES = {"F": "activations", "grad": "gradients"}


def weight_layers(chunk: nn.Module) -> list[nn.Module]:
    """The modules of ``chunk`` that own weights: its linear layers, norms and embeddings."""
    return [mod for mod in chunk.modules() if any(True for _ in mod.parameters(recurse=False))]


def forward_step(chunk: nn.Module, *args, keep_edges: bool = True, **kwargs):
    """``chunk(*args, **kwargs)``, and where each layer with weights handed its output on to the graph (its
    gradient edge): the point the weight-gradient step restarts from. Edges keep the graph's nodes, not the
    outputs. A schedule with no W step needs none (``keep_edges=False``): hooking every layer for each
    micro-batch is Python work on the critical path."""
    edges = []  # (layer, the edges of its outputs): a fused tensor-parallel QKV layer has three

    def keep(mod, args, y):
        edges.append((mod, tuple(get_gradient_edge(t) for t in (y if isinstance(y, tuple) else (y,)))))
    hooks = [mod.register_forward_hook(keep) for mod in weight_layers(chunk)] if keep_edges else []
    try:
        out = chunk(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return out, edges


def backward_input(out, grad, x, edges):
    """The zero-bubble paper's B (I here): the gradient of the chunk's input and of every weight layer's
    output, and nothing else: with no parameter among the inputs, autograd skips every weight-gradient
    product. Keeps the graph (``retain_graph``) for :func:`backward_weight`. Returns ``(input gradient or
    None, kept for W)``."""
    inputs = ([x] if x.requires_grad else []) + [edge for _, outs in edges for edge in outs]
    grads = list(torch.autograd.grad(out, inputs, grad, retain_graph=True))
    input_grad = grads.pop(0) if x.requires_grad else None
    kept = []
    for mod, outs in edges:
        kept.append((mod, outs, grads[:len(outs)]))
        del grads[:len(outs)]
    return input_grad, kept


def backward_weight(kept) -> None:
    """The zero-bubble paper's W: each weight layer's gradients from the gradient at its own output, which
    :func:`backward_input` kept. Autograd walks from that output to the layer's own weights only; the rest of
    the graph, and with it the activations saved for the input gradients, is freed when ``kept`` is
    dropped."""
    for mod, outs, grads_out in kept:
        params = list(mod.parameters(recurse=False))
        for p, g in zip(params, torch.autograd.grad(list(outs), params, grads_out)):
            p.grad = g if p.grad is None else p.grad + g  # accumulate over micro-batches


class Executor:
    """One rank's run of schedule ``s`` on its ``chunks`` (``{chunk index: chunk}``) for one global batch,
    split into ``s.m`` micro-batches: each method runs one action; what a backward needs is ``kept``."""

    def __init__(self, s: Schedule, chunks: dict[int, GPT], tokens, targets, *, group=None, positions=None,
                 activation_shape=None, timeout_s=None, stage_seconds=None, record_saved=True):
        validate(s)
        self.rank = dist.get_rank(group)
        if sorted(chunks) != s.chunks_of(self.rank):
            raise ValueError(f"rank {self.rank} runs chunks {s.chunks_of(self.rank)} in {s.name}, "
                             f"but was given {sorted(chunks)}")
        if tokens.shape[0] % s.m:
            raise ValueError(f"m={s.m} micro-batches must divide the batch of {tokens.shape[0]} sequences")
        self.s, self.chunks, self.positions, self.last = s, chunks, positions, s.n_chunks - 1
        self.xs, self.ys = tokens.chunk(s.m), targets.chunk(s.m)
        some_chunk = next(iter(chunks.values()))
        shape = activation_shape or (*self.xs[0].shape, some_chunk.cfg.d_model)  # between two chunks
        weight = next(some_chunk.parameters())
        like = torch.empty(shape, dtype=weight.dtype, device=weight.device)  # received where the chunk is
        self.mail = _Mailbox(s, group, like, timeout_s)
        stage_share = {kind: t / len(chunks) for kind, t in (stage_seconds or {}).items()}  # a chunk's
        self.timeline = Timeline(chunks.values(), stage_share, record_saved)
        self.splits_backward = any(a.kind == "W" for a in s.actions[self.rank])  # zero-bubble: keep edges
        self.kept, self.losses = {}, {}

    def forward(self, a: Action, step: int) -> None:
        c, i = a.chunk, a.micro_batch
        x = self.xs[i] if c == 0 else self.mail.recv("F", c - 1, i, step).requires_grad_()
        target = self.ys[i] if c == self.last else None
        with self.timeline.computing("F"):  # padded before the send: the next rank starts after it
            out, edges = forward_step(self.chunks[c], x, target, positions=self.positions,
                                      keep_edges=self.splits_backward)
            if c == self.last:  # the chunk's own loss; this micro-batch's share of the batch's mean
                self.losses[str(i)] = out[1].detach()
                out = out[1] / self.s.m
        if c < self.last:
            self.mail.send(out, "F", c, i, step)
        self.kept[(c, i)] = (x, out, edges)

    def backward(self, a: Action, step: int) -> None:
        c, i = a.chunk, a.micro_batch
        x, out, edges = self.kept.pop((c, i))
        grad = None if c == self.last else self.mail.recv("grad", c + 1, i, step)
        with self.timeline.computing(a.kind):
            if a.kind == "B":
                torch.autograd.backward(out, grad)
                input_grad = x.grad
            else:  # only the activations' gradients now; what W needs is kept, not the input and output
                input_grad, self.kept[(c, i)] = backward_input(out, grad, x, edges)
        if c > 0:
            self.mail.send(input_grad, "grad", c, i, step)

    def weight(self, a: Action, step: int) -> None:
        with self.timeline.computing("W"):
            backward_weight(self.kept.pop((a.chunk, a.micro_batch)))


def run_schedule(s: Schedule, chunks: dict[int, GPT], tokens: torch.Tensor, targets: torch.Tensor, *,
                 group=None, positions=None, activation_shape=None, timeout_s: float | None = None,
                 stage_seconds: dict | None = None, embedding_group=None, record_saved: bool = True):
    """Run this rank's (``dist.get_rank(group)``) actions of ``s`` on its ``chunks`` (``{chunk index:
    chunk}``) for one global batch, split into ``s.m`` micro-batches. Gradients accumulate into the chunks'
    parameters. Every chunk is given ``positions`` (by default ``0 … time-1``); ``activation_shape`` is
    the shape of the tensors between chunks (by default ``(micro-batch, time, d_model)``).

    ``stage_seconds`` (e.g. ``{"F": 0.02, "B": 0.04, "I": 0.02, "W": 0.02}``, for a whole stage; a chunk of a
    rank holding ``v`` chunks takes ``1/v`` of it) pads every action with a sleep to a fixed duration, so that
    the timeline shows the schedule rather than the ranks' competition for the machine's cores.
    ``record_saved=False`` leaves the bytes of saved activations unmeasured (``None`` in the events): the
    hook on every tensor autograd saves is Python work a training loop that never reads them need not do.

    A tied embedding's two copies have their gradients summed after the last action
    (:func:`allreduce_embedding_grads`, over ``embedding_group``, which a rank holding one copy must pass).

    Returns ``(losses, events)``: each micro-batch's loss on the rank that runs the last chunk (else empty),
    and one :class:`helpers.parallel.pipeline_timeline.Event` per action. The schedule is validated first,
    so a bad one raises a :class:`helpers.cost.pipeline_schedules.ScheduleError` before any message is
    sent.
    """
    _check_embedding_group(chunks, embedding_group)  # before any message is sent
    run = Executor(s, chunks, tokens, targets, group=group, positions=positions,
                   activation_shape=activation_shape, timeout_s=timeout_s, stage_seconds=stage_seconds,
                   record_saved=record_saved)
    actions = {"F": run.forward, "B": run.backward, "I": run.backward, "W": run.weight}
    try:
        for step, a in enumerate(s.actions[run.rank]):
            actions[a.kind](a, step)
            run.timeline.record(a)  # its times, and the bytes still saved for backward
        run.mail.flush()
    finally:
        run.timeline.close()
    allreduce_embedding_grads(chunks, embedding_group)
    return run.losses, run.timeline.events


# ---------------------------------------------------------------------------------------------------------
# PyTorch's pipelining on the same chunks
# ---------------------------------------------------------------------------------------------------------


def torch_stage_indices(style: str, rank: int, p: int, v: int) -> list[int]:
    """The chunks rank ``rank`` of ``p`` holds: ``loop`` (chunk ``c`` on rank ``c mod p``) or ``v`` (ranks
    ``0…p-1`` then back)."""
    if style == "v":
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(v)]


def torch_pipeline(schedule_cls, model: GPT, tokens, targets, m: int, *, style="loop", v: int = 1, group=None,
                   **schedule_kwargs):
    """One step of ``torch.distributed.pipelining``'s ``schedule_cls`` on the same chunks as
    :func:`run_schedule`, over the ranks of ``group``.

    Each stage calls its chunk without targets, so the last returns logits, to which the schedule applies its
    loss function: each micro-batch's mean loss; with ``scale_grads=True`` (the default) the schedule divides
    the accumulated gradients by ``m``: the same gradients as the whole batch's mean loss. A tied embedding's
    copies are then summed over their :func:`embedding_group`, as after :func:`run_schedule`.
    Returns ``(losses, chunks)``.
    """
    from torch.distributed.pipelining import PipelineStage

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    n_chunks = v * p if style == "loop" else 2 * p
    mine = torch_stage_indices(style, rank, p, v)
    chunks = {c: pipeline_chunk(model, c, n_chunks) for c in mine}
    stages = [PipelineStage(chunks[c], c, n_chunks, device(), group=group) for c in mine]
    schedule = schedule_cls(stages[0] if len(stages) == 1 else stages, n_microbatches=m,
                            loss_fn=cross_entropy, **schedule_kwargs)
    losses: list = []
    args = (tokens,) if 0 in mine else ()
    kwargs = {"target": targets, "losses": losses} if n_chunks - 1 in mine else {}
    schedule.step(*args, **kwargs)
    placement = [next(r for r in range(p) if c in torch_stage_indices(style, r, p, v))
                 for c in range(n_chunks)]
    allreduce_embedding_grads(chunks, embedding_group(placement, group))
    return [float(x.detach()) for x in losses], list(chunks.values())
