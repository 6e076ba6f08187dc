"""The CPU backend of greedy tree acceptance (``swk_greedy_path`` in ``kernels/cpu/cpu_topk.cpp``, from the one
kernel library). Its twin is sample/rejection.py's host walk, which runs where this returns None."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.ops import native


def greedy_path(x: torch.Tensor, parents: list, tokens: list) -> Optional[tuple]:
    """(accepted nodes root..last as a list, bonus token) of greedy acceptance on a tree's scores x [N, V], or
    None where the kernel does not apply (not CPU float32 [N, V], library not loaded or switched off)."""
    n = len(parents)
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] == n
            and len(tokens) == n and x.is_contiguous() and native.active()):
        return None
    path, bonus = (ctypes.c_int64 * n)(), ctypes.c_int64()
    L = native.library().swk_greedy_path(x.data_ptr(), n, x.shape[1], (ctypes.c_int64 * n)(*parents),
                                         (ctypes.c_int64 * n)(*tokens), path, ctypes.byref(bonus))
    if L < 1:
        raise SwiftkError(f"greedy_path: kernel rejected a tree of {n} nodes (parents {parents[:8]}...)")
    return path[:L], bonus.value
