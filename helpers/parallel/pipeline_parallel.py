"""Pipeline parallelism from scratch (chapter 06): the book's GPT cut into chunks, and one executor for any
schedule.

- :class:`PipelineChunk` is a contiguous run of the GPT's layers (the first chunk also embeds the tokens, the
  last also normalises, projects to the vocabulary and returns the loss); :func:`split_model` cuts the
  reference into ``n_chunks`` of them, with the layers of
  :func:`helpers.parallel.pipeline_schedules.stage_layers`.
- :func:`run_schedule` runs one rank's list of actions from a
  :class:`helpers.parallel.pipeline_schedules.Schedule`. Activations travel forward and their gradients
  backward by point-to-point messages, each tagged with its kind, chunk and micro-batch, so a message can only
  be taken for the one it is; sends are asynchronous and receives wait, so the order the schedule gives is the
  order the rank works in. Every message is counted in :data:`helpers.parallel.ledger.LEDGER` as it is posted;
  every action is written into the rank's list of :class:`Event` s, with the bytes :class:`SavedActivations`
  measured afterwards.
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
import time
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks

from helpers import layout_rules
from helpers.dist import collective_timeout
from helpers.model import GPT, GPTConfig, cross_entropy
from helpers.parallel.ledger import LEDGER, Message
from helpers.parallel.pipeline_schedules import Action, Schedule, stage_layers, validate


def check_layout(cfg: GPTConfig, n_chunks: int) -> None:
    """Raise a ValueError naming the broken constraint if ``cfg`` cannot be cut into ``n_chunks`` chunks."""
    layout_rules.pipeline_parallel(n_chunks, cfg.n_layers)
    if cfg.tie_embeddings and n_chunks > 1:
        raise ValueError("tie_embeddings=True puts one weight on the first and the last chunk: build the "
                         "pipeline model with tie_embeddings=False (or all-reduce that weight's gradient "
                         "between the two stages, as Megatron-LM does)")


class PipelineChunk(nn.Module):
    """Layers ``layers`` of the book's GPT, copied from ``reference``; the first chunk embeds, the last one
    ends with the final norm and the LM head. Its forward maps token ids (first chunk) or activations to
    activations (or, for the last chunk, logits)."""

    def __init__(self, reference: GPT, index: int, n_chunks: int):
        super().__init__()
        check_layout(reference.cfg, n_chunks)
        self.index, self.n_chunks = index, n_chunks
        self.layers = stage_layers(reference.cfg.n_layers, n_chunks)[index]
        self.first, self.last = index == 0, index == n_chunks - 1
        if self.first:
            self.tok_emb, self.pos_emb = copy.deepcopy(reference.tok_emb), copy.deepcopy(reference.pos_emb)
        self.blocks = nn.ModuleList(copy.deepcopy(reference.blocks[i]) for i in self.layers)
        if self.last:
            self.ln_f, self.lm_head = copy.deepcopy(reference.ln_f), copy.deepcopy(reference.lm_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x

    def reference_names(self) -> dict[str, nn.Parameter]:
        """This chunk's parameters under the reference model's names (``blocks.5.…`` rather than
        ``blocks.1.…``)."""
        out = {}
        for name, p in self.named_parameters():
            if name.startswith("blocks."):
                local, rest = name[len("blocks."):].split(".", 1)
                name = f"blocks.{self.layers[int(local)]}.{rest}"
            out[name] = p
        return out


def split_model(reference: GPT, n_chunks: int) -> list[PipelineChunk]:
    """The reference cut into ``n_chunks`` chunks along its depth."""
    return [PipelineChunk(reference, c, n_chunks) for c in range(n_chunks)]


def chunk_grads(chunks) -> dict[str, torch.Tensor]:
    """The gradients of some chunks, under the reference's names."""
    return {n: p.grad.detach().clone() for c in chunks for n, p in c.reference_names().items()}


def chunk_params(chunks) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for c in chunks for n, p in c.reference_names().items()}


# ---------------------------------------------------------------------------------------------------------
# The executor
# ---------------------------------------------------------------------------------------------------------


class Event(NamedTuple):
    """One action as a rank ran it: when it began waiting for its input, when it started computing, when the
    computation ended and when the action ended (later if it was padded to a fixed duration), on
    ``time.perf_counter``, the machine's monotonic clock, the same in every process; and the bytes of
    activations the rank's transformer blocks still had saved for backward afterwards, measured by
    :class:`SavedActivations`."""

    kind: str
    chunk: int
    micro_batch: int
    waited: float
    start: float
    computed: float
    end: float
    saved_bytes: int


class _Saved:
    """What autograd keeps in place of one saved tensor while a :class:`SavedActivations` watches: it lives
    exactly as long as autograd keeps the tensor for backward."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class SavedActivations:
    """The bytes of the tensors that autograd keeps saved for backward inside the transformer blocks of
    ``chunks``, live: while a block runs its forward, a ``saved_tensors_hooks`` pack hook wraps every tensor
    autograd saves in a holder that autograd keeps instead of the tensor and drops when it frees it. Each
    storage counts once; the parameters (``F.linear`` saves the weight) are left out, since they are not
    activations."""

    def __init__(self, chunks):
        self.params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
        self.live: dict[int, list] = {}  # storage pointer: [bytes, holders]
        self.bytes = 0
        self._contexts: list = []
        self._handles = [h for c in chunks for block in c.blocks
                         for h in (block.register_forward_pre_hook(self._enter),
                                   block.register_forward_hook(self._exit))]

    def _enter(self, module, args):
        self._contexts.append(saved_tensors_hooks(self._pack, self._unpack))
        self._contexts[-1].__enter__()

    def _exit(self, module, args, output):
        self._contexts.pop().__exit__(None, None, None)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.params:
            return tensor
        entry = self.live.setdefault(storage.data_ptr(), [storage.nbytes(), 0])
        self.bytes += entry[0] if entry[1] == 0 else 0
        entry[1] += 1
        # detached: a saved output would hold its own node
        return _Saved(tensor.detach(), self, storage.data_ptr())

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[key]

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _tag(kind: str, chunk: int, micro_batch: int, m: int) -> int:
    """One tag per message: the activation leaving ``chunk`` (kind "F") or the gradient of its input
    ("grad")."""
    return 2 * (chunk * m + micro_batch) + (kind == "grad")


class _Mailbox:
    """Point-to-point messages of one rank: asynchronous tagged sends, waited receives, each counted in the
    ledger with the bytes of the tensor it carries."""

    def __init__(self, s: Schedule, rank: int, group, timeout_s: float):
        self.s, self.rank, self.group, self.timeout_s = s, rank, group, timeout_s
        self.pending: list = []
        self.local: dict = {}  # messages between two chunks of the same rank need no network

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def send(self, tensor, kind: str, chunk: int, micro_batch: int, dst: int, step: int) -> None:
        tensor = tensor.detach().contiguous()
        if dst == self.rank:
            self.local[(kind, chunk, micro_batch)] = tensor
            return
        phase = "activations" if kind == "F" else "gradients"
        nbytes = tensor.numel() * tensor.element_size()
        LEDGER.messages.append(Message("pipeline", phase, step, "send", dst, nbytes))
        self.pending.append(dist.isend(tensor, self._peer(dst), group=self.group,
                                       tag=_tag(kind, chunk, micro_batch, self.s.m)))

    def recv(self, like, kind: str, chunk: int, micro_batch: int, src: int, step: int, action: Action):
        if src == self.rank:
            return self.local.pop((kind, chunk, micro_batch))
        buf = torch.empty_like(like)
        phase = "activations" if kind == "F" else "gradients"
        nbytes = buf.numel() * buf.element_size()
        LEDGER.messages.append(Message("pipeline", phase, step, "recv", src, nbytes))
        work = dist.irecv(buf, self._peer(src), group=self.group,
                          tag=_tag(kind, chunk, micro_batch, self.s.m))
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            raise RuntimeError(f"rank {self.rank}, action {step} ({action}): nothing arrived from rank {src} "
                               f"within {self.timeout_s:.0f} s ({err})") from None
        return buf

    def flush(self) -> None:
        for work in self.pending:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        self.pending.clear()


def weight_layers(chunk: nn.Module) -> list[nn.Module]:
    """The modules of ``chunk`` that own weights: its linear layers, norms and embeddings."""
    return [mod for mod in chunk.modules() if any(True for _ in mod.parameters(recurse=False))]


def forward_step(chunk: PipelineChunk, x: torch.Tensor):
    """``chunk(x)``, and where each layer with weights handed its output on to the graph (its gradient edge):
    the point the weight-gradient step restarts from. Edges keep the graph's nodes, not the outputs."""
    edges = []
    hooks = [mod.register_forward_hook(lambda mod, args, y: edges.append((mod, get_gradient_edge(y))))
             for mod in weight_layers(chunk)]
    try:
        out = chunk(x)
    finally:
        for h in hooks:
            h.remove()
    return out, edges


def backward_input(out, grad, x, edges):
    """The zero-bubble paper's B (I here): the gradient of the chunk's input and of every weight layer's
    output, and nothing else: with no parameter among the inputs, autograd skips every weight-gradient
    product. Keeps the graph (``retain_graph``) for :func:`backward_weight`. Returns ``(input gradient or
    None, kept for W)``."""
    inputs = ([x] if x.requires_grad else []) + [edge for _, edge in edges]
    grads = torch.autograd.grad(out, inputs, grad, retain_graph=True)
    input_grad = grads[0] if x.requires_grad else None
    return input_grad, [(mod, edge, g) for (mod, edge), g in zip(edges, grads[len(grads) - len(edges):])]


def backward_weight(kept) -> None:
    """The zero-bubble paper's W: each weight layer's gradients from the gradient at its own output, which
    :func:`backward_input` kept. Autograd walks from that output to the layer's own weights only; the rest of
    the graph, and with it the activations saved for the input gradients, is freed when ``kept`` is
    dropped."""
    for mod, edge, grad_out in kept:
        params = list(mod.parameters(recurse=False))
        for p, g in zip(params, torch.autograd.grad(edge, params, grad_out)):
            p.grad = g if p.grad is None else p.grad + g  # accumulate over micro-batches


def _pad(start: float, seconds: float | None) -> tuple[float, float]:
    """When the computation ended, and when the action ends: padded by a sleep to ``seconds`` after
    ``start``."""
    computed = time.perf_counter()
    if seconds:
        time.sleep(max(0.0, start + seconds - computed))
    return computed, time.perf_counter()


def run_schedule(s: Schedule, chunks: dict[int, PipelineChunk], tokens: torch.Tensor, targets: torch.Tensor,
                 rank: int, *, group=None, timeout_s: float | None = None, stage_seconds: dict | None = None):
    """Run rank ``rank``'s actions of ``s`` on its ``chunks`` (``{chunk index: PipelineChunk}``) for one
    global batch, split into ``s.m`` micro-batches. Gradients accumulate into the chunks' parameters.

    ``stage_seconds`` (e.g. ``{"F": 0.02, "B": 0.04, "I": 0.02, "W": 0.02}``, for a whole stage; a chunk of a
    rank holding ``v`` chunks takes ``1/v`` of it) pads every action with a sleep to a fixed duration, so that
    the timeline shows the schedule rather than the ranks' competition for the machine's cores.

    Returns ``(losses, events)``: each micro-batch's loss on the rank that runs the last chunk (else empty),
    and one :class:`Event` per action. The schedule is validated first, so a bad one raises a
    :class:`helpers.parallel.pipeline_schedules.ScheduleError` before any message is sent.
    """
    validate(s)
    if sorted(chunks) != s.chunks_of(rank):
        raise ValueError(f"rank {rank} runs chunks {s.chunks_of(rank)} in {s.name}, "
                         f"but was given {sorted(chunks)}")
    if tokens.shape[0] % s.m:
        raise ValueError(f"m={s.m} micro-batches must divide the batch of {tokens.shape[0]} sequences")
    xs, ys = tokens.chunk(s.m), targets.chunk(s.m)
    some_chunk = next(iter(chunks.values()))
    d_model = some_chunk.blocks[0].ln1.normalized_shape[0]
    dtype = next(some_chunk.parameters()).dtype
    like = torch.empty(*xs[0].shape, d_model, dtype=dtype)  # the activations between chunks
    mail = _Mailbox(s, rank, group, timeout_s or collective_timeout())
    seconds = {kind: t / len(chunks) for kind, t in (stage_seconds or {}).items()}
    saved = SavedActivations(chunks.values())
    kept, losses, events = {}, {}, []
    last = s.n_chunks - 1
    try:
        for step, a in enumerate(s.actions[rank]):
            c, i = a.chunk, a.micro_batch
            waited = time.perf_counter()
            if a.kind == "F":
                if c == 0:
                    x = xs[i]
                else:
                    x = mail.recv(like, "F", c - 1, i, s.placement[c - 1], step, a).requires_grad_()
                start = time.perf_counter()
                out, edges = forward_step(chunks[c], x)
                if c == last:
                    out = cross_entropy(out, ys[i]) / s.m  # this micro-batch's share of the batch's mean loss
                    losses[str(i)] = out.detach() * s.m
                # padded before the send: the next rank starts after it
                computed, end = _pad(start, seconds.get("F"))
                if c < last:
                    mail.send(out, "F", c, i, s.placement[c + 1], step)
                kept[(c, i)] = (x, out, edges)
            elif a.kind in ("B", "I"):
                x, out, edges = kept.pop((c, i))
                grad = None if c == last else mail.recv(like, "grad", c + 1, i, s.placement[c + 1], step, a)
                start = time.perf_counter()
                if a.kind == "B":
                    torch.autograd.backward(out, grad)
                    input_grad = x.grad
                else:  # only the activations' gradients now; what W needs is kept, not the input and output
                    input_grad, kept[(c, i)] = backward_input(out, grad, x, edges)
                computed, end = _pad(start, seconds.get(a.kind))
                if c > 0:
                    mail.send(input_grad, "grad", c, i, s.placement[c - 1], step)
            else:
                start = time.perf_counter()
                backward_weight(kept.pop((c, i)))
                computed, end = _pad(start, seconds.get("W"))
            x = out = edges = grad = input_grad = None  # of this micro-batch only kept outlives the action
            events.append(Event(a.kind, c, i, waited, start, computed, end, saved.bytes))
        mail.flush()
    finally:
        saved.close()
    return losses, events


# ---------------------------------------------------------------------------------------------------------
# PyTorch's pipelining on the same chunks
# ---------------------------------------------------------------------------------------------------------


def torch_stage_indices(style: str, rank: int, p: int, v: int) -> list[int]:
    """The chunks a rank holds: ``loop`` (chunk ``c`` on rank ``c mod p``) or ``v`` (ranks ``0…p-1`` then
    back)."""
    if style == "v":
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(v)]


def torch_pipeline(schedule_cls, reference: GPT, tokens, targets, rank: int, p: int, m: int, *, style="loop",
                   v: int = 1, group=None, **schedule_kwargs):
    """One step of ``torch.distributed.pipelining``'s ``schedule_cls`` on the same chunks as
    :func:`run_schedule`.

    Its loss function returns each micro-batch's mean loss, and with ``scale_grads=True`` (the default) the
    schedule divides the accumulated gradients by ``m``: the same gradients as the whole batch's mean loss.
    Returns ``(losses, chunks)``.
    """
    from torch.distributed.pipelining import PipelineStage

    n_chunks = v * p if style == "loop" else 2 * p
    chunks = split_model(reference, n_chunks)
    mine = torch_stage_indices(style, rank, p, v)
    stages = [PipelineStage(chunks[c], c, n_chunks, torch.device("cpu"), group=group) for c in mine]
    single = len(stages) == 1
    schedule = schedule_cls(stages[0] if single else stages, n_microbatches=m, loss_fn=cross_entropy,
                            **schedule_kwargs)
    losses: list = []
    args = (tokens,) if 0 in mine else ()
    kwargs = {"target": targets, "losses": losses} if n_chunks - 1 in mine else {}
    schedule.step(*args, **kwargs)
    return [float(x.detach()) for x in losses], [chunks[c] for c in mine]
