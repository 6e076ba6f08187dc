"""Logits processing and random draws, shared by the target and the draft.

Speculative sampling is lossless only if the draft distribution q and the target distribution p are the
distributions the tokens were really drawn from / are judged against, so both sides go through the same
``process_logits``. Every random draw takes an explicit ``torch.Generator`` (on the tensors' device), which makes
runs reproducible and lets the draft and the verifier use separate streams.

Temperature 0 is greedy decoding; it has no distribution here: greedy callers take ``argmax`` (first index
wins ties, as ``torch.argmax`` does) and use ``rejection.accept_greedy``.
"""
from __future__ import annotations

import math

import torch

from swiftk.errors import SwiftkError


def _is_real(x) -> bool:
    """An int or float with a finite float value, and not a bool (True would silently mean 1)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float: dividing logits by it would fail later
        return False


MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e3


def validate_temperature(temperature: float) -> None:
    # inf would divide every logit to 0 (a uniform draw); nan would poison the probabilities.
    if not _is_real(temperature) or temperature < 0:
        raise SwiftkError(f"temperature must be a finite number >= 0, got {temperature!r}")
    # logits / t must stay finite in float32: below MIN_TEMPERATURE use 0 (greedy, the limit it tends to)
    if 0 < temperature < MIN_TEMPERATURE:
        raise SwiftkError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature!r}")
    # far above any useful value the distribution is uniform already, and a huge int overflows the division
    if temperature > MAX_TEMPERATURE:
        raise SwiftkError(f"temperature must be <= {MAX_TEMPERATURE:g}, got {temperature!r}")


def validate_top_p(top_p: float) -> None:
    if not _is_real(top_p) or not 0.0 < top_p <= 1.0:
        raise SwiftkError(f"top_p must be in (0, 1], got {top_p!r}")


def validate_top_k(top_k: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise SwiftkError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}")


def validate_sampling_params(temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
    """Raise SwiftkError naming the first bad parameter."""
    validate_temperature(temperature)
    validate_top_k(top_k)
    validate_top_p(top_p)


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> float32 probabilities [..., V]: temperature, then top-k, then top-p, then softmax.

    top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are all kept, so the
    result does not depend on how a backend orders equal values). top-p keeps the smallest prefix of the
    tokens sorted by probability (stable sort: lower index first among equals) whose cumulative probability
    reaches top_p; the most likely token is always kept.
    """
    validate_sampling_params(temperature, top_k, top_p)
    if temperature == 0:
        raise SwiftkError("temperature 0 is greedy decoding and has no distribution: use argmax")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise SwiftkError(f"logits must have a non-empty last (vocabulary) dimension, got shape {tuple(logits.shape)}")
    x = logits.float() / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        # Mass strictly before each token; a token is needed while that mass is still short of top_p.
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row: probs [..., V] -> LongTensor [...] (0-dim for a single distribution). No host sync."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k distinct tokens per row, probs [..., V] -> LongTensor [..., k], in draw order.

    Same distribution as k sequential draws that each renormalise over the tokens not yet drawn
    (exponential race: token i's key is p_i / E_i with E_i ~ Exp(1); the k largest keys, in order).
    If k exceeds the number of tokens with positive probability, the extra picks are zero-probability tokens;
    acceptance never accepts those (their conditional draft probability is 0), but callers should cap k.
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= probs.shape[-1]:
        raise SwiftkError(f"k must be an int in [1, vocab size {probs.shape[-1]}], got {k!r}")
    e = torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_(generator=generator)
    keys = probs.float() / e.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.topk(keys, k, dim=-1).indices
