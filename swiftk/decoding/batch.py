"""Several calls decoding together: every round, each call plans its round (decoding/loop.py's Decoder), then ONE
target pass computes every call's rows (Model.forward_batch: each call has its own KV cache), then each call
finishes its round. Calls join and leave between rounds.

Each row's logits are the bits the call would get decoding alone (the CPU kernels compute every row on its own), so
a call's tokens do not depend on what shares its passes.

Pricing: a draft row costs its share of a pass that also carries the other calls' rows. Before a call plans, its
gate learns the rows already in the pass, the tokens they are expected to yield and what a pass of T rows costs
here (a ``gate.Beside``, an argument of the call's plan: a least-squares line through the batch's own passes, seconds against rows); it keeps the
nodes that raise the pass's tokens per second. Where rows are compute-bound (int8 products on AVX2: ~0.4 of a step
each) that is almost never. The first call to plan rotates, so none always plans against an empty pass. Model
drafters rest while calls share passes (their draft passes are their own). Prefills ride along in chunks, so a
new prompt does not stall the others for its whole length.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from ..target.costs import LinearFit
from .gate import ALONE, Beside
from .loop import Decoder, Pass

# Prompt rows per pass while other calls decode (a prompt of 512 tokens joins over ~8 rounds), and while none does.
PREFILL_ROWS_BESIDE = 64
PREFILL_ROWS_ALONE = 256


class Batch:
    """The calls decoding together (their Decoders), on one model."""

    def __init__(self, model, whole_prompts: bool = False):
        """``whole_prompts``: a prompt decoded alone is prefilled in one pass (else in chunks of
        PREFILL_ROWS_ALONE rows, so that a call arriving meanwhile joins sooner)."""
        self.model = model
        self.prefill_alone = 1 << 62 if whole_prompts else PREFILL_ROWS_ALONE
        self.calls: list = []     # Decoders, in arrival order
        self._first = 0           # which call plans first this round (rotates)
        self.fit = LinearFit(0.95)   # seconds of the batch's decode passes (no prompt rows) against their rows

    def add(self, d: Decoder) -> None:
        self.calls.append(d)

    def remove(self, d: Decoder) -> None:
        self.calls.remove(d)

    def step(self, failed: Callable[[Decoder, BaseException], None]) -> None:
        """One round of every call. A call whose planning or finishing raises leaves the batch through
        ``failed(decoder, error)``; the others go on."""
        calls = [d for d in self.calls if not d.done]
        if not calls:
            return
        k = self._first % len(calls)
        self._first += 1
        order = calls[k:] + calls[:k]
        decoding = [d for d in order if not d.s.prefilling]
        prefilling = [d for d in order if d.s.prefilling]
        budget = PREFILL_ROWS_BESIDE if decoding else self.prefill_alone
        ab = self.fit.fit()
        price = (lambda T: ab[0] + ab[1] * T) if ab is not None else None
        plans: list = []   # (decoder, Pass)
        rows, tokens = 0, 0.0   # in the pass so far: rows, and the tokens they are expected to yield
        for d in prefilling:
            if budget <= 0:
                break
            p = self._plan(d, failed, budget)
            if p is not None:
                plans.append((d, p))
                budget -= p.rows.tokens.shape[0]
                rows += p.rows.tokens.shape[0]
        alone = len(calls) == 1
        for i, d in enumerate(decoding):
            left = len(decoding) - i - 1   # calls still to plan: one row and one token each at least
            p = self._plan(d, failed, alone=alone, beside=Beside(rows + left, tokens + left, None if alone else price))
            if p is not None:
                plans.append((d, p))
                rows += p.rows.tokens.shape[0]
                tokens += 1.0 + (sum(p.tree.value[1:]) if p.tree is not None else 0.0)
        shared = [(d, p) for d, p in plans if not p.solo]
        for d, p in plans:
            # a pass that starts mid-model (KVQ), or the only one: the call's own (the lone pass, CUDA graphs)
            if p.solo or len(shared) == 1:
                self._finish(d, p, failed, lambda: d.run(p))
        if len(shared) < 2:
            return
        t = time.perf_counter()
        try:
            out = self.model.forward_batch([p.rows for _, p in shared])
        except Exception as e:  # noqa: BLE001 - a failed pass fails the calls it carried, not the batch
            for d, _ in shared:
                failed(d, e)
            return
        dt = time.perf_counter() - t
        total = sum(p.rows.tokens.shape[0] for _, p in shared)
        # prompt chunks are priced apart (long passes run at another rate per row)
        if all(p.kind != "prefill" for _, p in shared):
            self.fit.add(total, dt)
            costs = shared[0][0].s.costs
            if costs.step is None:   # no call alone timed a step yet: drafts are priced from this pass (a prior's
                costs.observe_verify(total, dt)   # step share of it), so a fresh engine's batch drafts too
        for (d, p), logits in zip(shared, out):
            d.s.stats.shared_passes += 1
            try:
                d.finish(p, logits, dt, timed=False)   # a shared pass is not one call's step
            except Exception as e:  # noqa: BLE001
                failed(d, e)

    def _plan(self, d: Decoder, failed, limit: int = 0, alone: bool = True, beside: Beside = ALONE) -> Optional[Pass]:
        try:
            return d.plan(limit, alone, beside)
        except Exception as e:  # noqa: BLE001 - a source or callback that raises fails its own call
            failed(d, e)
            return None

    def _finish(self, d: Decoder, p: Pass, failed, run) -> None:
        try:
            t = time.perf_counter()
            logits = run()
            d.finish(p, logits, time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001
            failed(d, e)

