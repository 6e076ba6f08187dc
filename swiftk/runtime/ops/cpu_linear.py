"""The CPU backend of the float matmul: ``kernels/cpu/cpu_linear.cpp`` (the skinny matmul), bound from the one
kernel library (ops/native.py builds, loads and types it).

``linear(x, w, scale=None)`` computes ``x @ w.T`` (times ``scale`` per output row for int8 weights) for the few
rows of a decode step, a draft step or a verify pass; see the .cpp file for why it beats MKL there and for its
batch invariance. Its torch twin is :func:`swiftk.runtime.ops.reference.linear`.

Without the library (no compiler, no AVX2+FMA, a failed build, ``SWIFTK_CPU_KERNELS=0``) or switched off
(``native.set_enabled(False)``) the runtime uses torch's matmul; :func:`status` says which and why (``swiftk info``).
"""
from __future__ import annotations

from typing import Optional

import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.ops import native

_W_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call)."""
    return native.library() is not None


def status() -> str:
    """One line for ``swiftk info``: which matmul serves CPU linears, and why."""
    lib = native.library()
    if lib is not None:
        width = lib.swk_vector_width()
        return (f"swiftk kernel (kernels/cpu/cpu_linear.cpp, {'AVX-512' if width == 16 else 'AVX2'}; library "
                f"{native.source()})")
    return f"torch matmul ({native.why()})"


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The kernel takes 2-D contiguous CPU x (float32/bfloat16) and w (float32/bfloat16/int8) of matching K."""
    return (x.device.type == "cpu" and w.device.type == "cpu" and x.dim() == 2 and w.dim() == 2
            and x.dtype in (torch.float32, torch.bfloat16) and w.dtype in _W_TYPES
            and x.shape[1] == w.shape[1] and x.shape[0] >= 1 and w.is_contiguous())


def linear(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None,
           threads: Optional[int] = None) -> torch.Tensor:
    """y [M, N] float32 = x [M, K] @ w [N, K].T (* scale [N] when w is int8). Raises SwiftkError on bad input."""
    if not available():
        raise SwiftkError(f"CPU linear kernel unavailable: {native.why()}")
    if not supports(x, w):
        raise SwiftkError(f"cpu linear: unsupported operands x {tuple(x.shape)} {x.dtype} {x.device}, "
                          f"w {tuple(w.shape)} {w.dtype} {w.device} (contiguous: {w.is_contiguous()})")
    wt = _W_TYPES[w.dtype]
    if (wt == 2) != (scale is not None):
        raise SwiftkError("cpu linear: int8 weights need a float32 per-row scale, other weights take none")
    if scale is not None and (scale.dtype != torch.float32 or scale.shape != (w.shape[0],)
                              or not scale.is_contiguous()):
        raise SwiftkError(f"cpu linear: scale must be float32 [{w.shape[0]}] contiguous")
    return fast(x.float(), w, scale, threads)


def fast(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None,
         threads: Optional[int] = None) -> torch.Tensor:
    """The runtime's hot path: x [M, K] @ w.T (* scale) in x's dtype, for operands the caller knows
    :func:`supports` (model weights are checked once at load). Call only after :func:`available` returned True."""
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    M, N = xf.shape[0], w.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if native.library().swk_linear(xf.data_ptr(), M, xf.shape[1], w.data_ptr(), _W_TYPES[w.dtype],
                                   None if scale is None else scale.data_ptr(), N, y.data_ptr(),
                                   threads or torch.get_num_threads()) != 0:
        raise SwiftkError(f"cpu linear: kernel rejected x {tuple(x.shape)}, w {tuple(w.shape)} {w.dtype}")
    return y if x.dtype == torch.float32 else y.to(x.dtype)
