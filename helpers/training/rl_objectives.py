"""The objectives of reinforcement learning on language models, each from its paper (chapter 14).

Shapes: a batch holds ``B = n_prompts * responses_per_prompt`` responses, prompt-major (the responses to
one prompt, GRPO's "group", are adjacent); ``rewards`` are (B,), one outcome reward per response; per-token
tensors (log-probabilities, advantages, losses) are (B, T) with ``mask`` (B, T) equal to 1 on response tokens
and 0 on padding. Losses are per token and to be minimised (the objective negated); :func:`aggregate` makes
a scalar.

- Advantages: :func:`gae` (PPO's critic-based estimate, Schulman et al. 2016); :func:`grpo_advantages`
  (Shao et al. 2024), :func:`dr_grpo_advantages` (Liu et al. 2025), :func:`rloo_advantages` (Ahmadian et al.
  2024, after Kool et al. 2019), :func:`reinforce_pp_advantages` (Hu et al. 2025).
- Per-token losses: :func:`ppo_clip_loss` (Schulman et al. 2017) with DAPO's decoupled clip (Yu et al.
  2025) and the dual clip (Ye et al. 2020); :func:`gspo_loss` (Zheng et al. 2025); :func:`cispo_loss`
  (MiniMax 2025).
- Aggregation: :func:`aggregate` and the weight it gives each token, :func:`token_weights`.
- DAPO's other two pieces: :func:`overlong_penalty` and :func:`informative_prompts` (dynamic sampling).
- KL estimators (Schulman 2020): :func:`kl_k1`, :func:`kl_k2`, :func:`kl_k3`.
- The training-inference mismatch: :func:`tis_weights` (truncated importance sampling, Yao et al. 2025) and
  :func:`mis_weights` (masked importance sampling, Ling Team 2025; Liu et al. 2025).
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")


# ---------------------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------------------


def by_prompt(rewards: torch.Tensor, responses_per_prompt: int) -> torch.Tensor:
    """``rewards`` (B,) viewed as (prompts, responses_per_prompt): one row per prompt, GRPO's group."""
    if responses_per_prompt < 2:
        raise ValueError(f"a baseline from the other responses needs at least 2 responses per prompt, got "
                         f"responses_per_prompt={responses_per_prompt}")
    if rewards.dim() != 1 or rewards.numel() % responses_per_prompt:
        raise ValueError(f"a batch of {rewards.numel()} rewards (shape {tuple(rewards.shape)}) does not "
                         f"split into prompts of {responses_per_prompt} responses each")
    return rewards.view(-1, responses_per_prompt)


def _centred(rewards: torch.Tensor, responses_per_prompt: int) -> torch.Tensor:
    """``r`` minus the mean of its prompt's rewards, exactly 0 where they are all equal (whatever the rounding
    of the mean)."""
    g = by_prompt(rewards, responses_per_prompt)
    equal = (g == g[:, :1]).all(dim=1, keepdim=True)
    return torch.where(equal, torch.zeros_like(g), g - g.mean(dim=1, keepdim=True))


def grpo_advantages(rewards: torch.Tensor, responses_per_prompt: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024): ``(r - mean) / (std + eps)`` over the responses to the same prompt, the
    sample std (n - 1), as verl and TRL compute it. A prompt whose rewards are all equal has no signal: its
    advantages are exactly 0, never 0/0."""
    g = by_prompt(rewards, responses_per_prompt)
    return (_centred(rewards, responses_per_prompt) / (g.std(dim=1, keepdim=True) + eps)).flatten()


def dr_grpo_advantages(rewards: torch.Tensor, responses_per_prompt: int) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): ``r - mean`` over the prompt's responses, without GRPO's division by the
    std."""
    return _centred(rewards, responses_per_prompt).flatten()


def rloo_advantages(rewards: torch.Tensor, responses_per_prompt: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, Kool et al. 2019): ``r_i`` minus the mean of the *other* responses to its
    prompt, ``r_i - (sum - r_i) / (G - 1)``, which is ``G / (G - 1)`` times ``r_i - mean``: computed so, it
    is exactly 0 where the rewards are all equal."""
    g = responses_per_prompt
    return _centred(rewards, g).flatten() * (g / (g - 1))


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor,
                            responses_per_prompt: int | None = None, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025): each response's reward on every one of its tokens (minus its prompt's
    mean with ``responses_per_prompt``, their variant with a baseline), then normalised by the mean and std
    over every token of the whole batch, not per prompt. Its KL penalty in the reward is left out here."""
    r = rewards if responses_per_prompt is None else dr_grpo_advantages(rewards, responses_per_prompt)
    valid = mask.bool()
    per_token = r[:, None].expand(mask.shape)
    mean, std = per_token[valid].mean(), per_token[valid].std()
    return torch.where(valid, (per_token - mean) / (std + eps), torch.zeros_like(per_token))


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 1.0):
    """Generalised advantage estimation (Schulman et al. 2016) on (B, T) per-token rewards and values, the
    episode ending after T (pad both with zeros after a response's end):
    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``. Returns ``(A, A + V)``,
    the advantages and the critic's targets."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
        next_value = values[:, t]
    return advantages, advantages + values


# ---------------------------------------------------------------------------------------------------------
# Per-token losses
# ---------------------------------------------------------------------------------------------------------


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    """(B,) per response or (B, T) per token, as (B, T) or broadcastable to it."""
    return advantages[:, None] if advantages.dim() == 1 else advantages


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float = 0.2,
                  eps_high: float | None = None, dual_clip: float | None = None) -> torch.Tensor:
    """PPO's clipped surrogate (Schulman et al. 2017), negated: ``-min(rho A, clip(rho, 1 - eps_low,
    1 + eps_high) A)`` with ``rho = exp(logp - old_logp)``. ``eps_high`` defaults to ``eps_low`` (symmetric);
    a larger one is DAPO's clip-higher (Yu et al. 2025: 0.2 and 0.28). ``dual_clip = c > 1`` also bounds a
    negative-advantage token's loss by ``-c A`` (Ye et al. 2020), so a huge ratio cannot blow it up.
    ``advantages``: (B,) per response or (B, T) per token."""
    eps_high = eps_low if eps_high is None else eps_high
    A = _per_token(advantages)
    ratio = torch.exp(logp - old_logp)
    loss = -torch.min(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"the dual clip c must exceed 1, got {dual_clip}")
        loss = torch.where(A < 0, torch.min(loss, -dual_clip * A), loss)
    return loss


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              eps_low: float = 3e-4, eps_high: float = 4e-4) -> torch.Tensor:
    """GSPO (Zheng et al. 2025), negated: one ratio per response, its length-normalised likelihood ratio
    ``s = exp(mean_t (logp - old_logp))``, clipped per response, ``-min(s A, clip(s, 1 - eps_low,
    1 + eps_high) A)`` (the paper's ranges: 3e-4 and 4e-4). Returned on every token of its response, so that
    :func:`aggregate`'s ``seq-mean-token-mean`` gives the paper's mean over responses, gradient included."""
    lengths = mask.sum(dim=1).clamp(min=1)
    s = torch.exp(((logp - old_logp) * mask).sum(dim=1) / lengths)
    A = advantages if advantages.dim() == 1 else advantages[:, 0]
    per_response = -torch.min(s * A, s.clamp(1 - eps_low, 1 + eps_high) * A)
    return per_response[:, None].expand(logp.shape)


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_high: float,
               eps_low: float | None = None) -> torch.Tensor:
    """CISPO (MiniMax 2025), negated: ``-sg(clip(rho, 1 - eps_low, 1 + eps_high)) A log pi``. The importance
    weight is clipped and detached, so every token keeps a gradient ``clip(rho) A grad log pi``, where PPO's
    clip gives a clipped token none. MiniMax set no lower bound (``eps_low=None``)."""
    A = _per_token(advantages)
    ratio = torch.exp(logp - old_logp).detach()
    low = None if eps_low is None else 1 - eps_low
    return -ratio.clamp(low, 1 + eps_high) * A * logp


# ---------------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------------


def _check_mode(mode: str, max_len) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation {mode!r} is not one of {', '.join(AGGREGATIONS)}")
    if mode == "seq-mean-token-sum-norm" and max_len is None:
        raise ValueError("seq-mean-token-sum-norm divides by a constant length: give max_len")


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, max_len: int | None = None,
              n_sequences=None, n_tokens=None) -> torch.Tensor:
    """One scalar from per-token losses (B, T), counting only ``mask``'s tokens:

    - ``seq-mean-token-mean`` (GRPO): the mean over responses of each response's mean over its tokens;
    - ``token-mean`` (DAPO): the mean over every token of the batch;
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): each response's sum over its tokens, divided by a constant,
      ``n_sequences * max_len``.

    A data-parallel rank holds some of the responses: it passes the whole batch's ``n_sequences`` or
    ``n_tokens``, so that the ranks' losses add up to the single process's.

    A response with no tokens (its mask all 0) adds 0 and still counts in ``n_sequences``, as TRL's GRPO loss
    counts it (verl instead leaves it out of the count); a batch without any token gives 0. Never 0/0."""
    _check_mode(mode, max_len)
    mask = mask.to(loss.dtype)
    n_sequences = loss.shape[0] if n_sequences is None else n_sequences
    if mode == "token-mean":
        return (loss * mask).sum() / (mask.sum().clamp(min=1) if n_tokens is None else max(n_tokens, 1))
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / n_sequences
    return (loss * mask).sum() / (n_sequences * max_len)


def token_weights(mask: torch.Tensor, mode: str, max_len: int | None = None) -> torch.Tensor:
    """The weight each token's loss gets in :func:`aggregate`, written out: ``1 / (B |o_i|)``,
    ``1 / sum_i |o_i|`` or ``1 / (B max_len)``, on (B, T); 0 on a response with no tokens."""
    _check_mode(mode, max_len)
    mask = mask.to(torch.float64)
    lengths = mask.sum(dim=1, keepdim=True)
    if mode == "seq-mean-token-mean":
        return mask / (mask.shape[0] * lengths.clamp(min=1))
    if mode == "token-mean":
        return mask / lengths.sum().clamp(min=1)
    return mask / (mask.shape[0] * max_len)


# ---------------------------------------------------------------------------------------------------------
# DAPO's dynamic sampling and overlong penalty
# ---------------------------------------------------------------------------------------------------------


def informative_prompts(rewards: torch.Tensor, responses_per_prompt: int) -> torch.Tensor:
    """DAPO's dynamic sampling keeps the prompts whose responses' rewards are not all equal (Yu et al. 2025):
    (n_prompts,) booleans. Equal rewards have zero advantage under GRPO and give no gradient."""
    g = by_prompt(rewards, responses_per_prompt)
    return ~(g == g[:, :1]).all(dim=1)


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), added to the reward: 0 up to ``max_len - cache_len``
    tokens, then falling linearly to -1 at ``max_len``, and -1 beyond."""
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len={cache_len} must be in (0, max_len={max_len}]")
    lengths = lengths.to(torch.float64)
    return ((max_len - cache_len - lengths) / cache_len).clamp(-1.0, 0.0)


# ---------------------------------------------------------------------------------------------------------
# KL estimators and importance weights
# ---------------------------------------------------------------------------------------------------------


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k1 of KL(pi || pi_ref) at tokens drawn from pi: ``-log r``, ``r = pi_ref / pi``."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k2: ``(log r)^2 / 2``."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3: ``(r - 1) - log r``, GRPO's per-token KL penalty (Shao et al. 2024)."""
    log_r = ref_logp - logp
    return torch.expm1(log_r) - log_r


def tis_weights(train_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025): ``min(pi_train / pi_rollout, cap)``, detached. Per
    token, or per response when given each response's summed log-probabilities."""
    return torch.exp(train_logp - rollout_logp).detach().clamp(max=cap)


def mis_weights(train_logp: torch.Tensor, rollout_logp: torch.Tensor, low: float,
                high: float) -> torch.Tensor:
    """Masked importance sampling (Ling Team 2025's IcePop per token; Liu et al. 2025 per response): the
    ratio where it lies in ``[low, high]``, 0 elsewhere (the token or response is dropped, not truncated)."""
    ratio = torch.exp(train_logp - rollout_logp).detach()
    return torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
