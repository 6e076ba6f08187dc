"""Device and dtype arguments: parsed once, rejected with a SwiftkError naming the bad value."""
from __future__ import annotations

import torch

from ..errors import SwiftkError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise SwiftkError(f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16")


def check_device_dtype(device: torch.device, dtype: torch.dtype) -> None:
    # torch's CPU float16 matmuls are emulated and swiftk's CPU kernels read float32/bfloat16 only
    if device.type == "cpu" and dtype == torch.float16:
        raise SwiftkError("dtype float16 is for GPUs; on CPU use float32 (exact) or bfloat16")


def resolve_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise SwiftkError(f"invalid device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SwiftkError(f"device {device!r} requested but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise SwiftkError(f"unsupported device type {dev.type!r}; use 'cpu' or 'cuda'")
    return dev
