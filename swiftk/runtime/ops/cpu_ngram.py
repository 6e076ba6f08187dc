"""The CPU backend of the corpus n-gram chain walk (``kernels/cpu/cpu_ngram.cpp``, from the one kernel library):
the twin of proposers/datastore.py's Python walk, which serves where :func:`ngram_tables` returns None."""
from __future__ import annotations

import ctypes
import threading
from typing import Optional

import numpy as np

from swiftk.errors import SwiftkError
from swiftk.runtime.ops import native


class NgramTables:
    """Exact n-gram tables (swiftk/proposers/datastore.py's ``{n: (keys, next, count, key count)}``, int64, sorted
    keys) as the compiled chain walk reads them."""

    def __init__(self, lib, tables: dict, bits: int):
        self._lib = lib
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
        n = self._lib.swk_ngram_propose(self.ptrs, self.lens, self.max_n, self.bits, b["ctx"], len(ctx), k,
                                        None if probs is None else b["prob"], nb, float(floor), b["tok"], b["bucket"])
        if n < 0:
            raise SwiftkError(f"ngram tables: kernel rejected max_n={self.max_n}, context of {len(ctx)}, k={k}")
        return b["tok"][:n], b["bucket"][:n]


def ngram_tables(tables: dict, bits: int) -> Optional[NgramTables]:
    """The compiled walk over ``tables`` where the library is already loaded (and not switched off), else None:
    never a build inside a decode call (a GPU engine never loads it, and its corpus source walks in Python)."""
    lib = native.loaded()
    if not (1 <= len(tables) <= 4 and lib is not None):
        return None
    return NgramTables(lib, tables, bits)
