"""Triton rotary position embedding (rotate-half, HF layout) from a positions tensor.

Reference twin: swiftk.runtime.ops.reference.apply_rope. inv_freq already carries any llama3 / freq-factor scaling.
Angles are formed in inv_freq's dtype; for float64 they are reduced mod 2*pi in float64 before the float32
cos/sin, which keeps large positions accurate. x may be any strided [T, H, hd] view with unit stride in hd, e.g.
the q and k heads of a fused qkv projection viewed as [T, H + KV, hd], so one launch rotates q and k together.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from swiftk.errors import SwiftkError

from ._triton_util import check_float, last_dim_contiguous, next_pow2


@triton.jit
def _rope_kernel(x_ptr, out_ptr, pos_ptr, invf_ptr, H, HALF,
                 sxt, sxh, sot, soh,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, RANGE_REDUCE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    i = tl.arange(0, BLOCK_HALF)
    mi = i < HALF
    pos = tl.load(pos_ptr + t)
    invf = tl.load(invf_ptr + i, mask=mi, other=0.0)
    ang = pos.to(invf.dtype) * invf
    if RANGE_REDUCE:
        TWO_PI: tl.constexpr = 6.283185307179586
        ang = ang - tl.floor(ang / TWO_PI) * TWO_PI
    angf = ang.to(tl.float32)
    c = tl.cos(angf)[None, :]
    s = tl.sin(angf)[None, :]
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (h < H)[:, None] & mi[None, :]
    xb = x_ptr + t * sxt + h[:, None].to(tl.int64) * sxh + i[None, :]
    x1 = tl.load(xb, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF, mask=m, other=0.0).to(tl.float32)
    ob = out_ptr + t * sot + h[:, None].to(tl.int64) * soh + i[None, :]
    tl.store(ob, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(ob + HALF, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=m)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, H, hd] -> rotated copy."""
    check_float("apply_rope x", x)
    if x.dim() != 3:
        raise SwiftkError(f"apply_rope: x must be [T, H, head_dim], got {tuple(x.shape)}")
    T, H, hd = x.shape
    if hd % 2:
        raise SwiftkError(f"apply_rope: head_dim {hd} must be even")
    if inv_freq.shape != (hd // 2,):
        raise SwiftkError(f"apply_rope: inv_freq shape {tuple(inv_freq.shape)} != ({hd // 2},)")
    if inv_freq.dtype not in (torch.float32, torch.float64):
        raise SwiftkError(f"apply_rope: inv_freq dtype {inv_freq.dtype} must be float32 or float64")
    if positions.shape != (T,) or positions.dtype not in (torch.int32, torch.int64):
        raise SwiftkError(f"apply_rope: positions must be int [{T}], got {positions.dtype} {tuple(positions.shape)}")
    x = last_dim_contiguous(x)
    out = torch.empty((T, H, hd), dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return out
    BLOCK_H = min(16, next_pow2(H))
    grid = (T, triton.cdiv(H, BLOCK_H))
    _rope_kernel[grid](x, out, positions.contiguous(), inv_freq.contiguous(), H, hd // 2,
                       x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                       BLOCK_H=BLOCK_H, BLOCK_HALF=next_pow2(hd // 2),
                       RANGE_REDUCE=inv_freq.dtype == torch.float64)
    return out
