"""Triton KV commit: copy the accepted path's cache slots to contiguous slots, all layers in one launch.

Reference twin: swiftk.runtime.ops.reference.kv_commit. One program owns one (layer, k|v, kv head) plane and moves every
slot of the path for it, a chunk of head_dim columns at a time: it loads the chunk of every source row, then a
barrier, then stores, so overlapping src/dst (e.g. src = [5, 7, 9], dst = [4, 5, 6]) read the old values. Chunks
touch disjoint columns and each plane is touched by exactly one program, so nothing else can race with it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from swiftk.errors import SwiftkError

from ._triton_util import check_float, next_pow2

TILE_ELEMS = 8192  # rows x columns held in registers per chunk
MAX_SLOTS = TILE_ELEMS // 2  # at least two columns per chunk


@triton.jit
def _kv_commit_kernel(cache_ptr, src_ptr, dst_ptr, n, HD, KV, s_l, s_c, s_h, s_s,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    h = pid % KV
    c = (pid // KV) % 2
    layer = pid // (2 * KV)
    base = cache_ptr + layer * s_l + c * s_c + h * s_h
    i = tl.arange(0, BLOCK_N)
    mi = i < n
    src = tl.load(src_ptr + i, mask=mi, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + i, mask=mi, other=0).to(tl.int64)
    for d0 in range(0, HD, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = mi[:, None] & (d < HD)[None, :]
        vals = tl.load(base + src[:, None] * s_s + d[None, :], mask=m)
        tl.debug_barrier()  # every read of these columns completes before any write to them
        tl.store(base + dst[:, None] * s_s + d[None, :], vals, mask=m)


def kv_commit(cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    check_float("kv_commit cache", cache)
    if cache.dim() != 5 or cache.shape[1] != 2:
        raise SwiftkError(f"kv_commit: cache must be [L, 2, KV, S, hd], got {tuple(cache.shape)}")
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise SwiftkError(f"kv_commit: src {tuple(src_slots.shape)} / dst {tuple(dst_slots.shape)} must be equal 1-D")
    for name, s in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if s.dtype not in (torch.int32, torch.int64):
            raise SwiftkError(f"kv_commit: {name} dtype {s.dtype} must be int32/int64")
        if s.device != cache.device:
            raise SwiftkError(f"kv_commit: {name} on {s.device}, cache on {cache.device}")
    if cache.stride(-1) != 1:
        raise SwiftkError("kv_commit: cache needs unit stride in head_dim")
    L, _, KV, S, hd = cache.shape
    n = src_slots.shape[0]
    if n == 0 or L == 0 or KV == 0:
        return
    if n > MAX_SLOTS:
        raise SwiftkError(f"kv_commit: {n} slots in one commit, the Triton kernel takes at most {MAX_SLOTS}")
    BLOCK_N = next_pow2(n)
    BLOCK_D = min(next_pow2(hd), TILE_ELEMS // BLOCK_N)
    _kv_commit_kernel[(L * 2 * KV,)](cache, src_slots.contiguous(), dst_slots.contiguous(), n, hd, KV,
                                     cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
                                     BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
