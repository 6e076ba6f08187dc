"""Triton attention over the KV cache: tree attention (packed ancestor bits) and dense-masked attention.

Reference twins: swiftk.runtime.ops.reference.tree_attention / attention.

Layout: one program per (block of query rows, kv head). A row is (new token t, query head of that kv head's GQA
group), so the g query heads sharing a kv head read each K/V tile once, and single-token decode still fills
the tile with g rows. Online softmax (running max / sum) in float32 with exp2.

Tree mode keys: committed slots [0, prefix_len) are visible to every query (their bit loads are masked off), and
the T new tokens at slots prefix_len + j are visible to query t iff bit j of tree_bits[t] (pack_tree_mask format:
bit j%32 of int32 word j//32). Dense mode reads a [T, S] bool mask. One loop over key tiles serves both.

Limits: head_dim <= 256 (any value, padded to a power of two internally); q/k/v need unit stride in head_dim; any
other strides (e.g. k_cache = cache[l, 0, :, :S]) are used as given, the cache is never copied.
Not done: split-KV (flash-decoding) parallelism for very long prefixes at T=1.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from swiftk.errors import SwiftkError

from ._triton_util import INTERPRET, check_float, last_dim_contiguous, next_pow2

MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634
_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": fully masked tiles then contribute exactly zero without NaNs


@triton.jit
def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bits_ptr, mask_ptr, limit_ptr,
                 T, G, HD, n_prefix, n_keys,
                 sqt, sqh, skh, sks, svh, svs, sot, soh, sbt, smt, sms,
                 scale_log2e,
                 TREE: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 DOT_F32: tl.constexpr, PREC: tl.constexpr):
    kvh = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < T * G
    t = (r // G).to(tl.int64)
    h = kvh * G + (r % G)
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    q = tl.load(q_ptr + t[:, None] * sqt + h[:, None] * sqh + d[None, :],
                mask=row_ok[:, None] & dm[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = k_ptr + kvh * skh
    v_base = v_ptr + kvh * svh
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_LIMIT:   # a bound read on the device: a captured graph serves every cache length
        n_keys = tl.minimum(tl.load(limit_ptr), n_keys)
    for start in range(0, n_keys, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N)
        key_ok = s < n_keys
        lm = row_ok[:, None] & key_ok[None, :]
        if TREE:
            # committed slots (< n_prefix) are visible to all; new token j = s - n_prefix per the ancestor bits
            j = s - n_prefix
            in_tree = (j >= 0) & key_ok
            words = tl.load(bits_ptr + t[:, None] * sbt + (j // 32)[None, :], mask=lm & in_tree[None, :], other=0)
            visible = lm & ((s < n_prefix)[None, :] | (((words >> (j % 32)[None, :]) & 1) != 0))
        else:
            mk = tl.load(mask_ptr + t[:, None] * smt + s[None, :] * sms, mask=lm, other=0)
            visible = lm & (mk != 0)
        kv_mask = key_ok[:, None] & dm[None, :]
        k = tl.load(k_base + s[:, None] * sks + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + s[:, None] * svs + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2e
        qk = tl.where(visible, qk, _NEG)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(visible, tl.exp2(qk - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(o_ptr + t[:, None] * sot + h[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dm[None, :])


def _check_qkv(q, k_cache, v_cache, S_needed: int, op: str):
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(f"{op} {name}", t)
        if t.dim() != 3:
            raise SwiftkError(f"{op}: {name} must be 3-D, got shape {tuple(t.shape)}")
    T, H, hd = q.shape
    KV = k_cache.shape[0]
    if v_cache.shape != k_cache.shape:
        raise SwiftkError(f"{op}: v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    if k_cache.shape[2] != hd:
        raise SwiftkError(f"{op}: cache head_dim {k_cache.shape[2]} != q head_dim {hd}")
    if KV == 0 or H % KV:
        raise SwiftkError(f"{op}: {H} query heads not a multiple of {KV} kv heads")
    if hd > MAX_HEAD_DIM:
        raise SwiftkError(f"{op}: head_dim {hd} > {MAX_HEAD_DIM} not supported by the Triton kernel")
    if k_cache.shape[1] < S_needed:
        raise SwiftkError(f"{op}: cache holds {k_cache.shape[1]} slots, {S_needed} needed")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise SwiftkError(f"{op}: k/v cache need unit stride in head_dim")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise SwiftkError(f"{op}: dtype mismatch q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    return T, H, hd, KV


def _launch(q, k_cache, v_cache, bits, mask, n_prefix: int, n_keys: int, scale: float, tree: bool,
            limit=None) -> torch.Tensor:
    T, H, hd = q.shape
    KV = k_cache.shape[0]
    G = H // KV
    out = torch.empty((T, H, hd), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    rows = T * G
    BLOCK_D = max(16, next_pow2(hd))
    if INTERPRET:  # the interpreter pays per op, not per FLOP: big tiles, few loop trips
        BLOCK_M, BLOCK_N = min(128, max(16, next_pow2(rows))), 128
    else:
        BLOCK_M, BLOCK_N = min(64, max(16, next_pow2(rows))), (64 if BLOCK_D <= 128 else 32)
    dot_f32 = INTERPRET or q.dtype == torch.float32
    grid = (triton.cdiv(rows, BLOCK_M), KV)
    _attn_kernel[grid](q, k_cache, v_cache, out, bits, mask, bits if limit is None else limit,
                       T, G, hd, n_prefix, n_keys,
                       q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                       v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
                       bits.stride(0), mask.stride(0), mask.stride(1),
                       float(scale) * _LOG2E,
                       TREE=tree, HAS_LIMIT=limit is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                       DOT_F32=dot_f32, PREC="ieee" if q.dtype == torch.float32 else "tf32")
    return out


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_len: int,
                   tree_bits: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, hd]; k/v_cache [KV, >= prefix_len + T, hd]; tree_bits [T, ceil(T/32)] int32 -> [T, H, hd]."""
    T = q.shape[0] if q.dim() == 3 else -1
    prefix_len = int(prefix_len)
    if prefix_len < 0:
        raise SwiftkError(f"tree_attention: prefix_len {prefix_len} < 0")
    _check_qkv(q, k_cache, v_cache, prefix_len + T, "tree_attention")
    W = (T + 31) // 32
    if tree_bits.dtype != torch.int32 or tree_bits.dim() != 2 or tree_bits.shape[0] != T or tree_bits.shape[1] < W:
        raise SwiftkError(f"tree_attention: tree_bits must be int32 [{T}, {W}], got {tree_bits.dtype} "
                          f"{tuple(tree_bits.shape)}")
    if tree_bits.device != q.device:
        raise SwiftkError(f"tree_attention: tree_bits on {tree_bits.device}, q on {q.device}")
    q = last_dim_contiguous(q)
    bits = last_dim_contiguous(tree_bits)
    return _launch(q, k_cache, v_cache, bits, bits, prefix_len, prefix_len + T, scale, tree=True)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
              scale: float, limit: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense-masked attention: mask [T, S] bool (True = may attend) over the first S cache slots. ``limit``: a
    one-element int tensor on q's device; key tiles from it on are not read (the mask must hide those slots)."""
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise SwiftkError(f"attention: mask must be bool [T, S], got {mask.dtype} {tuple(mask.shape)}")
    T, S = mask.shape
    _check_qkv(q, k_cache, v_cache, S, "attention")
    if q.shape[0] != T:
        raise SwiftkError(f"attention: mask has {T} rows, q has {q.shape[0]} tokens")
    q = last_dim_contiguous(q)
    if limit is not None and (limit.numel() != 1 or limit.dtype not in (torch.int32, torch.int64)
                              or limit.device != q.device):
        raise SwiftkError(f"attention: limit must be one int on {q.device}, got {limit.dtype} "
                          f"{tuple(limit.shape)} on {limit.device}")
    m8 = mask.view(torch.uint8)
    return _launch(q, k_cache, v_cache, m8, m8, 0, S, scale, tree=False, limit=limit)
