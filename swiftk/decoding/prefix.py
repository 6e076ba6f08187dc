"""What the engine's KV cache still holds from its last finished call, so the next prompt's shared start is not
prefilled again (the ``prefix_cache`` decode option; passes.prefill(reuse=...)).

Exact only where a prefill's rows equal decoding's bit for bit: the CPU's fused C layer loop, which runs prefills as
passes of the rows a decode step computes (tests/test_cpu_decode.py). Elsewhere (CUDA; CPU bfloat16, kernels off or
unbuilt) long passes take GEMM paths of their own, so a reused start could change the output: no reuse there.
"""
from __future__ import annotations

from typing import Optional

from ..errors import SwiftkError
from ..runtime.ops import cpu_layers


def inexact(model) -> Optional[str]:
    """Why reusing this model's KV across calls could change an output (None: it cannot). Asked at every call: the
    fused loop can be switched off for the process (cpu_layers.set_fused)."""
    if model.device.type != "cpu":
        return f"on {model.device.type} a prefill's rows are not held bit-identical to decoding"
    if not (model.fused_ok and cpu_layers.fused_active()):
        return ("this engine's passes do not run the fused C layer loop (CPU float32 with the kernels built and on), "
                "the only path whose prefill rows equal decoding's bit for bit")
    return None


def may_reuse(enabled: bool, asked: bool, model) -> bool:
    """Whether a call reuses: ``enabled`` (the option) where it is exact; refused where ``asked`` for explicitly
    (given to load or generate) but inexact, rather than ignored."""
    why = inexact(model) if enabled else None
    if why is not None and asked:
        raise SwiftkError(f"prefix_cache=True cannot be exact here: {why}")
    return enabled and why is None


class HeldPrefix:
    """The tokens whose KV fills a cache's slots [0, n) after a finished call, with the cache's epoch then (every
    ``KVCache.reset`` bumps it: a score, a benchmark's passes or a failed call in between void the record)."""

    def __init__(self):
        self._held = None

    def forget(self) -> None:
        self._held = None

    def record(self, cache, tokens: list) -> None:
        self._held = (cache.epoch, tokens[:cache.length])

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
