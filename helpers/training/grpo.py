"""A tiny RL run on the book's sums, in one process or on data-parallel ranks (chapter 14).

The task is built from :mod:`helpers.data`'s alphabet: a prompt ``a+b=`` with one-digit ``a`` and ``b``; the
policy (the book's GPT) writes up to :data:`MAX_NEW` tokens, and the reward is 1 when the digits before its
first newline are ``a + b``, else 0: a verifiable reward, as in RL on maths with a checker.

- :func:`warm_start`: a few supervised steps on correct lines (``reference.train_steps``), so the policy
  knows the format and some sums before RL starts;
- :func:`sample`: autoregressive sampling by inverse CDF from given uniform noise, so the same noise gives the
  same tokens wherever they are drawn; :func:`rollout_noise` draws the noise of one response to every prompt
  from its own seed;
- :func:`logprobs`, :func:`rewards`, :func:`response_mask`, :func:`expected_reward` (the exact probability of
  the right answer, averaged over all 100 problems);
- :func:`rl_step`: one step of GRPO, DAPO or GSPO (:class:`Algorithm`). With ``group`` (a process group) each
  rank samples its share of the responses to every prompt, the ranks all-gather the rewards so that each
  prompt's advantages are computed over all its responses, count the tokens together, and average their
  gradients with chapter 03's ``average_gradients``: the same step as one process, to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers.data import ALPHABET, STOI
from helpers.parallel import comms, data_parallel
from helpers.reference import train_steps
from helpers.training import rl_objectives as rl

PROMPT_LEN = 4  # "a+b="
MAX_NEW = 3     # an answer of up to 2 digits and its newline
NEWLINE = STOI["\n"]
VOCAB = len(ALPHABET)


def problems(n: int, seed: int) -> torch.Tensor:
    """``n`` pairs ``(a, b)`` of one-digit numbers, (n, 2), from a seeded generator.

    On the CPU, deliberately: a CPU generator draws the same numbers whatever the backend (a CUDA generator
    draws others), so the callers move the data to the model's device."""
    return torch.randint(0, 10, (n, 2), generator=torch.Generator().manual_seed(seed), device="cpu")


def all_problems() -> torch.Tensor:
    """Every pair ``(a, b)``, a and b in 0..9: (100, 2)."""
    return torch.cartesian_prod(torch.arange(10, device="cpu"), torch.arange(10, device="cpu"))  # as problems


def prompts(ab: torch.Tensor) -> torch.Tensor:
    """The prompts ``a+b=`` as token ids, (n, 4)."""
    n = ab.shape[0]
    return torch.stack([ab[:, 0], torch.full((n,), STOI["+"], device=ab.device), ab[:, 1],
                        torch.full((n,), STOI["="], device=ab.device)], dim=1)


def answers(ab: torch.Tensor) -> torch.Tensor:
    """The right responses, the digits of ``a + b`` and a newline, padded with newlines: (n, MAX_NEW)."""
    s = ab.sum(dim=1)
    two = s >= 10
    first = torch.where(two, s // 10, s)
    second = torch.where(two, s % 10, torch.full_like(s, NEWLINE))
    return torch.stack([first, second, torch.full_like(s, NEWLINE)], dim=1)


def response_mask(responses: torch.Tensor) -> torch.Tensor:
    """1 on each response's tokens up to and including its first newline (all of them if it has none)."""
    newline = (responses == NEWLINE).long()
    before = newline.cumsum(dim=1) - newline  # newlines strictly before each position
    return (before == 0).to(torch.float64)


def rewards(responses: torch.Tensor, ab: torch.Tensor) -> torch.Tensor:
    """1.0 where the response is the right answer followed by a newline, else 0.0: (n,)."""
    right = answers(ab)
    mask = response_mask(right).bool()
    return ((responses == right) | ~mask).all(dim=1).to(torch.float64)


def logprobs(model, prompts_: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """``log pi(response token | prompt, earlier tokens)`` for every response token, (n, MAX_NEW), in one
    teacher-forced forward pass; in fp32 at least (fp64 stays fp64)."""
    logits = model(torch.cat([prompts_, responses[:, :-1]], dim=1))[:, PROMPT_LEN - 1:]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, dim=-1).gather(-1, responses[..., None])[..., 0]


@torch.no_grad()
def sample(model, prompts_: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Responses of MAX_NEW tokens, token ``t`` of row ``i`` the first whose cumulative probability exceeds
    ``noise[i, t]`` (inverse-CDF sampling at temperature 1): the noise decides the tokens, not the rank that
    draws them."""
    seq = prompts_
    for t in range(MAX_NEW):
        logits = model(seq)[:, -1]
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        cdf = probs.cumsum(dim=-1)
        token = torch.searchsorted(cdf, (noise[:, t:t + 1] * cdf[:, -1:]).contiguous(), right=True)
        seq = torch.cat([seq, token.clamp(max=VOCAB - 1)], dim=1)
    return seq[:, PROMPT_LEN:]


def _device(model) -> torch.device:
    """Where the model's parameters are: the data drawn on the CPU goes there."""
    return next(model.parameters()).device


def rollout_noise(seed: int, step: int, members: range, n_prompts: int) -> torch.Tensor:
    """The uniform noise of the given responses (``members``: their indices among a prompt's responses) to
    every prompt at ``step``, (n_prompts, len(members), MAX_NEW): response ``g``'s noise comes from its own
    seed, so a rank that samples responses 2 and 3 draws exactly what one process draws for them."""
    seeds = [seed * 1_000_003 + step * 1_000 + g for g in members]
    # on the CPU with a CPU generator, as problems(): the same noise on every backend
    return torch.stack([torch.rand((n_prompts, MAX_NEW), dtype=torch.float64, device="cpu",
                                   generator=torch.Generator().manual_seed(s)) for s in seeds], dim=1)


@torch.no_grad()
def expected_reward(model, ab: torch.Tensor | None = None) -> float:
    """The policy's probability of writing the right answer, averaged over the problems (by default all 100):
    the expected reward, computed exactly from the probabilities, with no sampling noise."""
    ab = (all_problems() if ab is None else ab).to(_device(model))
    right = answers(ab)
    logp = (logprobs(model, prompts(ab), right) * response_mask(right)).sum(dim=1)
    return float(logp.exp().mean())


def warm_start(model, steps: int, rows: int, lr: float, seed: int = 0) -> list[float]:
    """``steps`` supervised steps on correct lines ``a+b=c`` (cross-entropy on the answer's tokens only: the
    targets of the prompt are -100, which the loss ignores), with the book's one training loop."""
    data = []
    for step in range(steps):
        ab = problems(rows, seed * 1_000_003 + 500_000 + step).to(_device(model))
        line = torch.cat([prompts(ab), answers(ab)], dim=1)
        targets = line[:, 1:].clone()
        targets[:, :PROMPT_LEN - 1] = -100
        targets[:, PROMPT_LEN - 1:][response_mask(answers(ab)) == 0] = -100
        data.append((line[:, :-1], targets))
    return train_steps(model, data, lr=lr)


@dataclass(frozen=True)
class Algorithm:
    """What a step does with a batch of prompts' responses: its loss, its clip and how it is aggregated."""

    name: str
    loss: str = "ppo"  # "ppo" (token ratios, clipped) or "gspo" (one ratio per response)
    eps_low: float = 0.2
    eps_high: float = 0.2
    aggregation: str = "seq-mean-token-mean"
    dynamic_sampling: bool = False  # drop the prompts whose rewards are all equal (without resampling)


GRPO = Algorithm("GRPO")
DAPO = Algorithm("DAPO", eps_high=0.28, aggregation="token-mean", dynamic_sampling=True)
GSPO = Algorithm("GSPO", loss="gspo", eps_low=3e-4, eps_high=4e-4)


def _members(responses_per_prompt: int, group) -> tuple[range, int]:
    """Which of each prompt's responses this rank samples, and the number of ranks (1 without a group)."""
    if group is None:
        return range(responses_per_prompt), 1
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if responses_per_prompt % world_size:
        raise ValueError(f"{responses_per_prompt} responses per prompt do not split evenly over {world_size} "
                         f"ranks")
    share = responses_per_prompt // world_size
    return range(rank * share, (rank + 1) * share), world_size


def rl_step(model, optimizer, algo: Algorithm, step: int, *, n_prompts: int, responses_per_prompt: int,
            updates: int = 2, seed: int = 0, group=None) -> dict:
    """One RL step: sample this rank's share of the responses to every prompt, reward them, compute each
    prompt's advantages over all its responses, and take ``updates`` optimizer steps on ``algo``'s loss
    (PPO's reuse of a batch: from the second on, the ratios move away from 1 and the clip acts).
    ``group``: the data-parallel process group, or None for one process."""
    members, world_size = _members(responses_per_prompt, group)
    ab = problems(n_prompts, seed * 1_000_003 + step).repeat_interleave(len(members), dim=0)
    ab = ab.to(_device(model))
    noise = rollout_noise(seed, step, members, n_prompts).flatten(0, 1).to(_device(model))
    p = prompts(ab)
    responses = sample(model, p, noise)
    mask = response_mask(responses)
    r = rewards(responses, ab).view(n_prompts, len(members))
    every = r if group is None else comms.all_gather(r, 1, group)  # (n_prompts, responses_per_prompt)
    advantages = rl.grpo_advantages(every.flatten(), responses_per_prompt).view(n_prompts, -1)
    advantages = advantages[:, members.start:members.stop].flatten()
    informative = rl.informative_prompts(every.flatten(), responses_per_prompt)
    kept = informative if algo.dynamic_sampling else torch.ones_like(informative)
    mask = mask * kept.repeat_interleave(len(members))[:, None]
    n_tokens = mask.sum()
    if group is not None:
        comms.all_reduce(n_tokens, group)
    n_sequences = int(kept.sum()) * responses_per_prompt
    old_logp = logprobs(model, p, responses).detach()
    losses = []
    for _ in range(updates if n_sequences else 0):  # nothing to learn if every prompt's rewards are equal
        logp = logprobs(model, p, responses)
        if algo.loss == "gspo":
            per_token = rl.gspo_loss(logp, old_logp, advantages, mask, algo.eps_low, algo.eps_high)
        else:
            per_token = rl.ppo_clip_loss(logp, old_logp, advantages, algo.eps_low, algo.eps_high)
        loss = rl.aggregate(per_token, mask, algo.aggregation, n_sequences=n_sequences, n_tokens=n_tokens)
        optimizer.zero_grad()
        (loss * world_size).backward()  # the ranks average gradients: each carries world_size x its share
        loss = loss.detach().clone()
        if group is not None:
            data_parallel.average_gradients(model, group)
            comms.all_reduce(loss, group)  # the ranks' shares add up to the whole batch's loss
        optimizer.step()
        losses.append(float(loss))
    return {"losses": losses, "reward": float(every.mean()), "responses": responses, "rewards": r,
            "informative": float(informative.double().mean())}


def train(model, algo: Algorithm, steps: int, *, lr: float, n_prompts: int, responses_per_prompt: int,
          updates: int = 2, seed: int = 0, group=None, track=False) -> dict:
    """``steps`` RL steps with AdamW; per step the mean reward of the batch, the losses, the share of
    prompts whose rewards are not all equal, and with ``track`` the exact expected reward over all 100
    problems before each step and after the last."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    history = {"reward": [], "losses": [], "expected": [], "informative": []}
    for step in range(steps):
        if track:
            history["expected"].append(expected_reward(model))
        out = rl_step(model, optimizer, algo, step, n_prompts=n_prompts,
                      responses_per_prompt=responses_per_prompt, updates=updates, seed=seed, group=group)
        for key in ("reward", "losses", "informative"):
            history[key].append(out[key])
    if track:
        history["expected"].append(expected_reward(model))
    return history
