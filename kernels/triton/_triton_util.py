"""Small helpers shared by the Triton launchers (shape checks, interpreter detection)."""
from __future__ import annotations

import os

import torch

from swiftk.errors import SwiftkError

# Triton's interpreter (TRITON_INTERPRET=1, used for CPU CI) has no bf16/fp16 tensor-core dot; the kernels
# upcast dot operands to fp32 there.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise SwiftkError(f"{name}: dtype {t.dtype} not supported (float32, float16, bfloat16)")


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels index the last dim with stride 1; copy only when that does not hold (small activations only)."""
    return t if t.stride(-1) == 1 else t.contiguous()
