"""What the engine's KV cache still holds from its last finished call, so the next prompt's shared start is not
prefilled again (the ``prefix_cache`` decode option; passes.prefill(reuse=...)).

Exact where a prefill's rows equal decoding's bit for bit, which the CPU runtime is held to (tests/test_cpu_decode.py);
CUDA's prefill and decode kernels are not, so reuse is refused there.
"""
from __future__ import annotations

from ..errors import SwiftkError


def check_prefix_cache(enabled: bool, device) -> None:
    if enabled and device.type != "cpu":
        raise SwiftkError(f"prefix_cache=True needs the CPU runtime: on {device.type} a prefill's rows are not held "
                          f"bit-identical to decoding, so a reused prompt start could change the output")


class HeldPrefix:
    """The tokens whose KV fills a cache's slots [0, n) after a finished call, with the cache's epoch then (every
    ``KVCache.reset`` bumps it: a score, a benchmark's passes or a failed call in between void the record)."""

    def __init__(self):
        self._held = None

    def forget(self) -> None:
        self._held = None

    def record(self, cache, tokens: list) -> None:
        self._held = (cache.epoch, list(tokens[:cache.length]))

    def shared(self, cache, ids: list) -> int:
        """How many of the prompt's first tokens still have their KV in ``cache``: all but the last at most (its
        pass gives the first new token); 0 when the record is void."""
        if self._held is None:
            return 0
        epoch, held = self._held
        if epoch != cache.epoch or len(held) > cache.length:
            return 0
        n, most = 0, min(len(held), len(ids) - 1)
        while n < most and held[n] == ids[n]:
            n += 1
        return n
