"""The CPU backend of the op ``kv_commit`` (kernels/cpu/cpu_kv.cpp, from the one kernel library ops/native.py
loads): the dispatch (ops/__init__.py) takes it for CPU caches when the library is loaded. Its torch twin is
:func:`swiftk.runtime.ops.reference.kv_commit`, which it falls back to for a cache it does not take (not float32 or
float16, or not contiguous)."""
from __future__ import annotations

import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.ops import native, reference


def available() -> bool:
    """Whether the kernel library is loaded (or can be: this loads it, as the CPU model does anyway)."""
    return native.library() is not None


def kv_commit(cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """cache [L, 2, KV, S, hd]: entries at ``src_slots`` of every layer and head moved to ``dst_slots``, in place."""
    if not (cache.device.type == "cpu" and cache.dtype in (torch.float32, torch.float16) and cache.is_contiguous() and cache.dim() == 5):
        return reference.kv_commit(cache, src_slots, dst_slots)
    src = src_slots.to(torch.int64).contiguous()
    dst = dst_slots.to(torch.int64).contiguous()
    if src.numel() != dst.numel():
        raise SwiftkError(f"kv_commit: {src.numel()} source slots for {dst.numel()} destinations")
    L, two, KV, S, hd = cache.shape
    rc = native.library().swk_kv_commit(cache.data_ptr(), L * two * KV, S, hd * cache.element_size(), src.data_ptr(), dst.data_ptr(),
                                       src.numel())
    if rc == -2:
        raise SwiftkError("kv_commit: out of memory for the kernel's buffer")
    if rc != 0:
        raise SwiftkError(f"kv_commit: slots out of range for a cache of {S} slots: {src.tolist()[:8]} -> "
                          f"{dst.tolist()[:8]}")
