"""The CPU kernels' float ops: ``kernels/cpu/cpu_linear.cpp`` (the skinny matmul), the fused layer loop
(``cpu_decode.cpp``), top-k and acceptance's greedy walk (``cpu_topk.cpp``), the n-gram chain walk
(``cpu_ngram.cpp``), bound from the one kernel library (ops/native.py builds and loads it).

``linear(x, w, scale=None)`` computes ``x @ w.T`` (times ``scale`` per output row for int8 weights) for the few
rows of a decode step, a draft step or a verify pass; see the .cpp file for why it beats MKL there and for its
batch invariance. Its torch twin is :func:`swiftk.runtime.ops.reference.linear`.

Without the library (no compiler, no AVX2+FMA, a failed build, ``SWIFTK_CPU_KERNELS=0``) the runtime uses torch's
matmul; :func:`status` says which and why (``swiftk info`` shows it).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional

import numpy as np
import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.ops import native
from swiftk.runtime.ops.native import ENV_VAR, FLAGS, source_path  # noqa: F401 (re-exported for tests, benches)

_W_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}

_lock = threading.Lock()
_enabled = True                 # set_enabled(False): this process uses torch matmul (benchmarks' A/B)
_lib = None
_why: Optional[str] = None      # reason the kernel is not used, once decided
_fn = None


def _load() -> None:
    global _lib, _why, _fn
    lib = native.library()
    if lib is None:
        _why = native.why()
        return
    fn = lib.swk_linear   # the ABI is typed by ops/cpu_abi.py as the library loads
    _lib, _fn, _why = lib, fn, ""


def _ensure() -> bool:
    if _why is None:
        with _lock:
            if _why is None:
                _load()
    return _fn is not None


def active() -> bool:
    """The runtime's check per linear: available and not switched off with :func:`set_enabled`."""
    return _enabled and (_fn is not None if _why is not None else _ensure())


def set_enabled(on: bool) -> None:
    """Switch CPU linears between this kernel and torch's matmul for this process (benchmarks, tests)."""
    global _enabled
    _enabled = bool(on)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on first call)."""
    return _ensure()


def status() -> str:
    """One line for ``swiftk info``: which matmul serves CPU linears, and why."""
    if _ensure():
        width = _lib.swk_vector_width()
        return (f"swiftk kernel (kernels/cpu/cpu_linear.cpp, {'AVX-512' if width == 16 else 'AVX2'}; library "
                f"{native.source()})")
    return f"torch matmul ({_why})"


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The kernel takes 2-D contiguous CPU x (float32/bfloat16) and w (float32/bfloat16/int8) of matching K."""
    return (x.device.type == "cpu" and w.device.type == "cpu" and x.dim() == 2 and w.dim() == 2
            and x.dtype in (torch.float32, torch.bfloat16) and w.dtype in _W_TYPES
            and x.shape[1] == w.shape[1] and x.shape[0] >= 1 and w.is_contiguous())


def linear(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None,
           threads: Optional[int] = None) -> torch.Tensor:
    """y [M, N] float32 = x [M, K] @ w [N, K].T (* scale [N] when w is int8). Raises SwiftkError on bad input."""
    if not _ensure():
        raise SwiftkError(f"CPU linear kernel unavailable: {_why}")
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
    if _fn(xf.data_ptr(), M, xf.shape[1], w.data_ptr(), _W_TYPES[w.dtype],
           None if scale is None else scale.data_ptr(), N, y.data_ptr(), threads or torch.get_num_threads()) != 0:
        raise SwiftkError(f"cpu linear: kernel rejected x {tuple(x.shape)}, w {tuple(w.shape)} {w.dtype}")
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def topk_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """[M, k] int64: the indices of each row's k largest values of x [M, V], in torch.topk's order (equal values
    by lower index, NaN first), so k = 1 is torch.argmax. CPU float32 through kernels/cpu/cpu_topk.cpp when the
    library is loaded, else torch."""
    if x.dim() == 1:
        return topk_rows(x[None], k)[0]
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and 1 <= k <= min(64, x.shape[1])
            and x.shape[0] >= 1 and active()):
        return x.argmax(dim=-1, keepdim=True) if k == 1 else x.topk(k, dim=-1).indices
    xc = x.contiguous()
    out = torch.empty(x.shape[0], k, dtype=torch.int64)
    if _lib.swk_topk_rows(xc.data_ptr(), xc.shape[0], xc.shape[1], k, out.data_ptr()) != 0:
        raise SwiftkError(f"cpu topk: kernel rejected x {tuple(x.shape)}, k={k}")
    return out


def greedy_path(x: torch.Tensor, parents: list, tokens: list) -> Optional[tuple]:
    """(accepted nodes root..last as a list, bonus token) of greedy acceptance on a tree's scores x [N, V]
    (kernels/cpu/cpu_topk.cpp's swk_greedy_path; twin: decoding/acceptance.py's host walk), or None where the
    kernel does not apply (not CPU float32 [N, V], library not loaded): the caller walks in Python."""
    n = len(parents)
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] == n
            and len(tokens) == n and x.is_contiguous() and active()):
        return None
    path, bonus = (ctypes.c_int64 * n)(), ctypes.c_int64()
    L = _lib.swk_greedy_path(x.data_ptr(), n, x.shape[1], (ctypes.c_int64 * n)(*parents),
                             (ctypes.c_int64 * n)(*tokens), path, ctypes.byref(bonus))
    if L < 1:
        raise SwiftkError(f"greedy_path: kernel rejected a tree of {n} nodes (parents {parents[:8]}...)")
    return path[:L], bonus.value


def topk_into(x: torch.Tensor, rows: list, table: torch.Tensor, table_rows: list) -> None:
    """``table[table_rows[m]] = topk_rows(x[rows[m]], k)`` for each m in order, k = table's width (int32 table
    [T, k]), without copying the rows out of x: one C call where the library is loaded, else torch."""
    k = table.shape[1]
    if len(rows) != len(table_rows) or any(not 0 <= r < x.shape[0] for r in rows) \
            or any(not 0 <= r < table.shape[0] for r in table_rows):
        raise SwiftkError(f"topk_into: rows {rows} of x {tuple(x.shape)} or table rows {table_rows} of "
                          f"{tuple(table.shape)} out of range")
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and rows
            and 1 <= k <= min(64, x.shape[1]) and table.dtype == torch.int32
            and table.is_contiguous() and active()):
        r = (ctypes.c_int64 * len(rows))(*rows)
        t = (ctypes.c_int64 * len(table_rows))(*table_rows)
        if _lib.swk_topk_into(x.data_ptr(), x.shape[0], x.shape[1], r, len(rows), k, table.data_ptr(),
                              table.shape[0], t) != 0:
            raise SwiftkError(f"cpu topk: kernel rejected rows {rows} of x {tuple(x.shape)} or table rows "
                              f"{table_rows} of {tuple(table.shape)}")
        return
    if rows:
        table[torch.tensor(table_rows, dtype=torch.long)] = topk_rows(x[rows].float(), k).to(torch.int32).cpu()


class NgramTables:
    """Exact n-gram tables (swiftk/proposers/datastore.py's ``{n: (keys, next, count, key count)}``, int64, sorted
    keys) as the compiled chain walk reads them: kernels/cpu/cpu_ngram.cpp, the twin of Datastore's Python walk."""

    def __init__(self, tables: dict, bits: int):
        self.max_n, self.bits = len(tables), bits
        self.arrays = [np.ascontiguousarray(a, dtype=np.int64) for n in range(1, self.max_n + 1) for a in tables[n]]
        self.ptrs = (ctypes.c_void_p * len(self.arrays))(*[a.ctypes.data for a in self.arrays])
        self.lens = (ctypes.c_int64 * self.max_n)(*[len(tables[n][0]) for n in range(1, self.max_n + 1)])
        self._bufs = threading.local()   # one corpus's tables serve every engine of its tokenizer, on any thread

    def propose(self, ctx: list, k: int, probs: Optional[list], floor: float) -> tuple:
        """(tokens, buckets) of the chain continuing ``ctx`` (its last max_n tokens), at most k <= 64; ``probs``:
        the estimate per bucket (at most 64 buckets) or None."""
        b = self._bufs.__dict__
        if not b:
            b.update(tok=(ctypes.c_int64 * 64)(), bucket=(ctypes.c_int32 * 64)(), ctx=(ctypes.c_int64 * 4)(),
                     prob=(ctypes.c_double * 64)())
        k, lim, ctx = min(k, 64), 1 << self.bits, ctx[-self.max_n:]
        b["ctx"][:len(ctx)] = [t if 0 <= t < lim else -1 for t in ctx]   # an id outside the tables ends the chain
        nb = 0 if probs is None else min(len(probs), 64)
        if nb:
            b["prob"][:nb] = probs[:nb]
        n = _lib.swk_ngram_propose(self.ptrs, self.lens, self.max_n, self.bits, b["ctx"], len(ctx), k,
                                   None if probs is None else b["prob"], nb, float(floor), b["tok"], b["bucket"])
        if n < 0:
            raise SwiftkError(f"ngram tables: kernel rejected max_n={self.max_n}, context of {len(ctx)}, k={k}")
        return b["tok"][:n], b["bucket"][:n]


def ngram_tables(tables: dict, bits: int) -> Optional[NgramTables]:
    """The compiled walk over ``tables`` where the library is already loaded (and not switched off), else None:
    never a build inside a decode call (a GPU engine never loads it, and its corpus source walks in Python)."""
    if not (1 <= len(tables) <= 4 and _enabled and _fn is not None):
        return None
    return NgramTables(tables, bits)


_fused = True   # set_fused(False): layers run op by op in torch (the A/B of kernels/cpu/cpu_decode.cpp)


def set_fused(on: bool) -> None:
    """Switch the fused CPU layer loop (kernels/cpu/cpu_decode.cpp) on or off for this process (benchmarks, tests);
    off, the layers run op by op through torch (with this kernel still serving their matmuls)."""
    global _fused
    _fused = bool(on)


def fused_active() -> bool:
    return _fused and active()


def set_attention_tiles(on: bool) -> None:
    """Passes of several tokens attend in tiles of keys shared by their rows (on, the default) or per token, as a
    decode step (off): the same bits, for this process (benchmarks' A/B, tests). Needs :func:`available`."""
    _lib.swk_set_attention_tiles(1 if on else 0)


def layers_fn():
    """The C entry ``swk_layers`` (see kernels/cpu/cpu_decode.cpp). Call only after :func:`available` returned True."""
    return _lib.swk_layers


def layers_multi_fn():
    """The C entry ``swk_layers_multi``: rows of several sequences, each with its own cache, in one pass."""
    return _lib.swk_layers_multi


def layer_table_width() -> int:
    """Addresses per layer that ``swk_layers`` reads (a check that the Python side builds its table to match)."""
    return int(_lib.swk_layer_table_width())


def reset() -> None:
    """Forget the load decision (tests: after changing SWIFTK_CPU_KERNELS); the library's too."""
    global _lib, _why, _fn
    with _lock:
        native.reset()
        _lib, _why, _fn = None, None, None
