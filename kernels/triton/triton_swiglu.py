"""Triton SwiGLU: gate_up [T, 2I] = [gate | up] (the fused gate/up projection output) -> silu(gate) * up [T, I].

Reference twin: swiftk.runtime.ops.reference.swiglu. silu is rounded to the activation dtype before the product, as the
reference does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from swiftk.errors import SwiftkError

from ._triton_util import INTERPRET, check_float, last_dim_contiguous, next_pow2


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, n_rows, I, stride_gu, stride_out, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    m = (rows < n_rows) & (cols < I)
    g_raw = tl.load(gu_ptr + rows * stride_gu + cols, mask=m, other=0.0)
    u = tl.load(gu_ptr + rows * stride_gu + I + cols, mask=m, other=0.0).to(tl.float32)
    g = g_raw.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(g_raw.dtype).to(tl.float32)
    tl.store(out_ptr + rows * stride_out + cols, (act * u).to(out_ptr.dtype.element_ty), mask=m)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    check_float("swiglu input", gate_up)
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise SwiftkError(f"swiglu: last dim {two_i} must be even ([gate | up])")
    I = two_i // 2
    gu = last_dim_contiguous(gate_up).reshape(-1, two_i)
    out = torch.empty((gu.shape[0], I), dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] and I:
        n = gu.shape[0]
        if INTERPRET:  # the interpreter pays per op: whole tensor in a few programs
            BLOCK = next_pow2(I)
            BLOCK_R = min(next_pow2(n), max(1, 32768 // BLOCK))
        else:
            BLOCK, BLOCK_R = min(1024, next_pow2(I)), 1
        _swiglu_kernel[(triton.cdiv(n, BLOCK_R), triton.cdiv(I, BLOCK))](gu, out, n, I, gu.stride(0), out.stride(0),
                                                                         BLOCK_R=BLOCK_R, BLOCK=BLOCK)
    return out.view(*gate_up.shape[:-1], I)
