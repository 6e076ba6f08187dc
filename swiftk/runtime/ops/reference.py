"""Torch reference twins of every op the runtime uses.

These are the ground truth: the Triton and CUDA kernels in ``kernels/`` are tested equal to them.
All shapes are for batch size 1 (speculative decoding serves one sequence); T = new tokens this pass.
Math runs in float32 where precision matters (norm statistics, softmax, RoPE angles), like HF transformers.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .masks import pack_tree_mask, unpack_tree_mask  # noqa: F401  (the bitmask format, owned by masks.py)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] -> x / rms(x) * weight, statistics in float32, result in x.dtype.

    float32: torch's fused rms_norm, one op (bit-identical to the formula below, which HF uses; see
    tests/test_model.py); other dtypes: the formula, with the statistics in float32 like HF."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def fused_add_rmsnorm(
    delta: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    skip_flag: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += delta (unless ``skip_flag`` is true: the sublayer was skipped), then RMSNorm.

    Returns (normed, new_residual). ``skip_flag`` is a 0-dim bool tensor read on device by the kernels,
    so one launch sequence serves every skip set.
    """
    if skip_flag is None:
        new_res = residual + delta
    else:
        new_res = torch.where(skip_flag, residual, residual + delta)
    return rmsnorm(new_res, weight, eps), new_res


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, head_dim/2] in float32 for the given positions (inv_freq may be float64)."""
    ang = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout). x [T, H, hd], positions [T] int, inv_freq [hd/2]."""
    return rope_with_tables(x, *rope_tables(positions, inv_freq))


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, 1, hd] float32 (each half repeated, HF's layout): computed once per forward pass, shared by
    every layer's q and k."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    return torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]


def rope_with_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (HF's formula; rotate_half(x) = [-x2, x1]) in float32, result in x.dtype."""
    xf = x.float()
    h = x.shape[-1] // 2
    rot = torch.cat([-xf[..., h:], xf[..., :h]], dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    limit: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Masked attention over cache slots with GQA.

    q [T, H, hd]; k_cache, v_cache [KV, S, hd] (the first S slots of the cache); mask [T, S] bool,
    True = may attend. Returns [T, H, hd]. Every query must see at least one slot. ``limit`` (a device int: the
    slots from it on are masked) lets a kernel stop reading there; here the mask already says it all.

    float32: torch's scaled_dot_product_attention, one op (what HF's default "sdpa" attention calls; held to
    :func:`attention_math` in tests/test_model.py); other dtypes: :func:`attention_math` (float32 math).
    """
    if q.dtype == torch.float32 and k_cache.dtype == torch.float32:
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_cache[None], v_cache[None],
                                             attn_mask=mask, scale=scale, enable_gqa=True)   # [1, H, T, hd]
        return out[0].transpose(0, 1)
    return attention_math(q, k_cache, v_cache, mask, scale)


def attention_math(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """:func:`attention` written out: float32 scores, masked softmax, weighted values."""
    T, H, hd = q.shape
    KV = k_cache.shape[0]
    g = H // KV
    qf = q.float().view(T, KV, g, hd).permute(1, 2, 0, 3)  # [KV, g, T, hd]
    scores = torch.matmul(qf, k_cache.float().transpose(-1, -2)[:, None]) * scale  # [KV, g, T, S]
    scores = scores.masked_fill(~mask[None, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = torch.matmul(p, v_cache.float()[:, None])  # [KV, g, T, hd]
    return out.permute(2, 0, 1, 3).reshape(T, H, hd).to(q.dtype)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: int,
    tree_bits: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention for T new tokens stored at slots [prefix_len, prefix_len+T).

    Each query sees all committed slots [0, prefix_len) and the new tokens its packed ancestor bitmask
    allows (``tree_bits`` [T, ceil(T/32)] int32; a causal chain is the lower triangle).
    """
    T = q.shape[0]
    tree = unpack_tree_mask(tree_bits, T)
    mask = torch.cat([torch.ones(T, prefix_len, dtype=torch.bool, device=q.device), tree], dim=1)
    S = prefix_len + T
    return attention(q, k_cache[:, :S], v_cache[:, :S], mask, scale)


def linear(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T in float32 (times ``scale`` [N] per output row for int8 weights): the twin of
    kernels/cpu/cpu_linear.cpp."""
    y = x.float() @ w.float().T
    return y if scale is None else y * scale


def kv_commit(cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Move accepted KV entries to contiguous slots, all layers at once, in place.

    cache [L, 2, KV, S, hd]; src_slots, dst_slots [n] int64. The gather on the right-hand side is
    materialised before the scatter, so overlapping src/dst ranges are safe.
    """
    cache[:, :, :, dst_slots] = cache[:, :, :, src_slots]
