"""The static KV cache: preallocated once, written by slot, its committed length moved only by its own methods."""
from __future__ import annotations

import torch

from .config import ModelConfig
from ..errors import SwiftkError
from .ops import get_ops

# kv_cache= names: the cache's element type. float16 halves the bytes a step reads at long contexts (the CPU loop
# rounds k and v when it writes them and widens them exactly when it reads them); it is a slightly different
# numerical model than float32, and decoding is lossless with respect to the one that runs.
KV_FORMATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_dtype(kv_cache, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype for ``kv_cache`` (None: the compute dtype): on the CPU, float32 or float16 for a float32
    model; elsewhere only the compute dtype (the GPU kernels attend over a cache of their own type)."""
    if kv_cache is None:
        return dtype
    if kv_cache not in KV_FORMATS:
        raise SwiftkError(f"kv_cache={kv_cache!r}: use one of {', '.join(KV_FORMATS)} (or None)")
    want = KV_FORMATS[kv_cache]
    cpu_ok = device.type == "cpu" and dtype == torch.float32 and want in (torch.float32, torch.float16)
    if want != dtype and not cpu_ok:
        raise SwiftkError(f"kv_cache={kv_cache!r} on {device} with {str(dtype).replace('torch.', '')} compute: "
                          f"a 16-bit cache under float32 compute runs on the CPU only; else use the compute dtype")
    return want


class KVCache:
    """Static cache ``[n_layers, 2, n_kv_heads, max_slots, head_dim]``; ``length`` = committed tokens, moved only
    by the cache's own methods.

    Rolling back a rejected draft is just not advancing ``length``: scratch slots past it get overwritten. Whoever
    rewrites committed slots starts with ``reset()``: the engine's prefix record (decoding/prefix.py) trusts
    ``epoch`` to tell it the slots it recorded may have changed.
    """

    def __init__(self, cfg: ModelConfig, max_slots: int, dtype: torch.dtype, device, ops=None):
        self.data = torch.zeros(cfg.n_layers, 2, cfg.n_kv_heads, max_slots, cfg.head_dim, dtype=dtype, device=device)
        self.max_slots = max_slots
        self._length = 0
        self.epoch = 0   # bumped by reset(): whoever records what the slots hold can tell they were rewritten since
        self._ops = ops or get_ops(device)

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._length = 0
        self.epoch += 1

    def copy_prefix(self, src: "KVCache", n: int) -> None:
        """Hold ``src``'s first ``n`` committed slots as this cache's committed prefix (a rewrite: epoch bumped)."""
        if not 0 <= n <= min(src.length, self.max_slots):
            raise SwiftkError(f"cannot copy {n} slots of a cache holding {src.length}")
        self.data[:, :, :, :n].copy_(src.data[:, :, :, :n])
        self._length = n
        self.epoch += 1

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` committed slots (their KV stays valid); the rest become scratch."""
        if not 0 <= n <= self._length:
            raise SwiftkError(f"cannot keep {n} of {self._length} committed slots")
        self._length = n

    def advance(self, n: int) -> None:
        """The ``n`` slots past the committed prefix (written in order by a pass) join it."""
        if not 0 <= self._length + n <= self.max_slots:
            raise SwiftkError(f"cannot commit {n} more slots after {self._length} (cache of {self.max_slots})")
        self._length += n

    def commit(self, path) -> None:
        """Append the accepted tree path (node indices root..last, a list or a tensor; node i sits in slot length+i)
        to the committed prefix: one gather/copy over all layers, skipped when the path is nodes 0..L-1 (already in
        place: a chain accepted along the first branch laid out, whoever drafted it). The decode loop passes a list:
        a tensor comparison per round costs ~10 us after a pass has flushed the caches."""
        n = self._length
        nodes = path.tolist() if isinstance(path, torch.Tensor) else list(path)
        L = len(nodes)
        if nodes != list(range(L)):
            dev = self.data.device
            self._ops.kv_commit(self.data, torch.tensor(nodes, device=dev) + n, torch.arange(n, n + L, device=dev))
        self.advance(L)
