"""Triton RMSNorm and skip-aware fused residual-add + RMSNorm.

Reference twins: swiftk.runtime.ops.reference.rmsnorm / fused_add_rmsnorm. One program normalises one row; statistics in
float32. The skip flag is read on device (0-dim bool tensor), so the same launch serves every skip set: a skipped
sublayer passes the residual through unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from swiftk.errors import SwiftkError

from ._triton_util import INTERPRET, check_float, last_dim_contiguous, next_pow2

MAX_D = 65536


@triton.jit
def _add_rmsnorm_kernel(delta_ptr, res_ptr, w_ptr, skip_ptr, normed_ptr, newres_ptr,
                        n_rows, D, stride_delta, stride_res, eps,
                        HAS_DELTA: tl.constexpr, HAS_SKIP: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = (rows < n_rows)[:, None] & (cols < D)[None, :]
    res = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=m, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + rows[:, None] * stride_delta + cols[None, :], mask=m, other=0.0)
        summed = (res.to(tl.float32) + delta.to(tl.float32)).to(newres_ptr.dtype.element_ty)
        if HAS_SKIP:
            skip = tl.load(skip_ptr) != 0
            x = tl.where(skip, res.to(newres_ptr.dtype.element_ty), summed)
        else:
            x = summed
        tl.store(newres_ptr + rows[:, None] * D + cols[None, :], x, mask=m)
    else:
        x = res
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / D
    # round the normalised value to the activation dtype before the weight product, like the reference
    y = (xf * tl.rsqrt(var + eps)[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(normed_ptr + rows[:, None] * D + cols[None, :], (w[None, :] * y).to(normed_ptr.dtype.element_ty),
             mask=m)


def _launch(dr, rr, weight, skip, normed, new_res, D, eps, has_delta):
    n = rr.shape[0]
    if not n:
        return
    BLOCK_D = next_pow2(D)
    # one row per program on a GPU; the interpreter pays per op, so it takes many rows at once
    BLOCK_R = min(next_pow2(n), max(1, 16384 // BLOCK_D)) if INTERPRET else 1
    _add_rmsnorm_kernel[(triton.cdiv(n, BLOCK_R),)](
        dr, rr, weight.contiguous(), skip if skip is not None else rr, normed, new_res,
        n, D, dr.stride(0), rr.stride(0), float(eps),
        HAS_DELTA=has_delta, HAS_SKIP=skip is not None, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D,
        num_warps=_warps(D))


def _warps(D: int) -> int:
    """About 8 elements per thread for wide rows (one program holds the whole row)."""
    return min(16, max(1, next_pow2(D) // 256))


def _rows(x: torch.Tensor, D: int) -> torch.Tensor:
    return last_dim_contiguous(x).reshape(-1, D)


def _check(x: torch.Tensor, weight: torch.Tensor) -> int:
    check_float("rmsnorm input", x)
    check_float("rmsnorm weight", weight)
    D = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != D:
        raise SwiftkError(f"rmsnorm: weight shape {tuple(weight.shape)} does not match hidden size {D}")
    if D > MAX_D:
        raise SwiftkError(f"rmsnorm: hidden size {D} > {MAX_D} not supported by the Triton kernel")
    return D


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    D = _check(x, weight)
    xr = _rows(x, D)
    out = torch.empty(xr.shape, dtype=torch.result_type(weight, x), device=x.device)
    _launch(xr, xr, weight, None, out, out, D, eps, has_delta=False)
    return out.view(x.shape)


def fused_add_rmsnorm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      skip_flag: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    D = _check(residual, weight)
    check_float("fused_add_rmsnorm delta", delta)
    if delta.shape != residual.shape:
        raise SwiftkError(f"fused_add_rmsnorm: delta {tuple(delta.shape)} != residual {tuple(residual.shape)}")
    dr, rr = _rows(delta, D), _rows(residual, D)
    res_dtype = torch.result_type(residual, delta)
    new_res = torch.empty(rr.shape, dtype=res_dtype, device=residual.device)
    normed = torch.empty(rr.shape, dtype=torch.result_type(weight, new_res), device=residual.device)
    skip = _skip_tensor(skip_flag, residual.device)
    _launch(dr, rr, weight, skip, normed, new_res, D, eps, has_delta=True)
    return normed.view(residual.shape), new_res.view(residual.shape)


def _skip_tensor(skip_flag, device) -> Optional[torch.Tensor]:
    """0-dim (or 1-element) bool/int tensor -> 1-element uint8 view on the same storage (no copy, no sync)."""
    if skip_flag is None:
        return None
    if not isinstance(skip_flag, torch.Tensor):
        return torch.tensor([bool(skip_flag)], dtype=torch.uint8, device=device)
    if skip_flag.numel() != 1:
        raise SwiftkError(f"skip_flag must hold one element, got shape {tuple(skip_flag.shape)}")
    if skip_flag.device != device:
        raise SwiftkError(f"skip_flag on {skip_flag.device}, activations on {device}")
    f = skip_flag.reshape(1)
    if f.dtype == torch.bool:
        return f.view(torch.uint8)
    return (f != 0).view(torch.uint8)
