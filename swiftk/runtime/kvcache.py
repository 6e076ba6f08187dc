"""The static KV cache: preallocated once, written by slot, its committed length moved only by its own methods."""
from __future__ import annotations

import torch

from .config import ModelConfig
from ..errors import SwiftkError
from .ops import get_ops


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
