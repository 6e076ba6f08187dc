"""A free source's host time against what it buys, for one call (the round consults a source only while it
pays; decoding/loop.py)."""
from __future__ import annotations

import math
import time


class SourceBudget:
    """Host time against what it buys, per free source, for one call: a source whose accepted nodes saved less
    time per round than its ``propose`` (and, for a learner, ``learn``) took is consulted only every ``gap``-th
    round (a probe), the gap doubling while it stays below its cost, back to 1 once it pays (``speculate="auto"``;
    with "always" every source is consulted every round). The gap stops where the source's cost per round falls
    under ``share`` of a plain step (at most ``max_gap``): value comes in bursts (a repeated answer, a copied
    block) whose start a skipped round misses, so a source that costs little next to a step (Qwen-0.5B: 0.4%) is
    never skipped.
    Why: on low-repetition text the corpus n-grams and Token Recycling cost ~3% of a step per round for almost no
    accepted token (bench/results/history.md); the gate prices proposals, not the rounds that produce nothing. The gain
    is gross (accepted tokens x a plain step): a source below its cost on that measure cannot pay."""

    def __init__(self, names, auto: bool = True, min_rounds: int = 8, max_gap: int = 16, share: float = 0.005):
        self.auto, self.min_rounds, self.max_gap = auto, min_rounds, max_gap   # auto False: every source, always
        self.share = share   # of a plain step: what an idle source may cost per round, averaged over its gap
        names = list(names)
        self.cost = {n: 0.0 for n in names}    # seconds spent per consulted round (mean, then EMA)
        self.gain = {n: 0.0 for n in names}    # seconds saved per consulted round (same)
        self.rounds = {n: 0 for n in names}
        self.gap = {n: 1 for n in names}
        self.wait = {n: 0 for n in names}
        self.spent: dict = {}                  # this round's seconds per source
        self.on = set(names)                   # the sources consulted this round

    def start_round(self) -> None:
        self.spent, self.on = {}, set()
        for n in self.cost:
            if self.wait[n] > 0:
                self.wait[n] -= 1
            else:
                self.on.add(n)

    def timed(self, name: str, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t
        return out

    def end_round(self, accepted: dict, step_s: float) -> None:
        """``accepted``: the tokens this round accepted per source; ``step_s``: a plain step's seconds."""
        for n in self.on:
            r = self.rounds[n] = self.rounds[n] + 1
            a = 1.0 / min(r, self.min_rounds)   # a plain mean over the first rounds, then an EMA
            self.cost[n] += a * (self.spent.get(n, 0.0) - self.cost[n])
            self.gain[n] += a * (accepted.get(n, 0) * step_s - self.gain[n])
            if not self.auto or r < self.min_rounds or self.gain[n] >= self.cost[n]:
                self.gap[n] = 1
            else:   # skipping rounds also skips a burst's start; only as far as its cost matters (< share)
                cap = min(self.max_gap, max(1, math.ceil(self.cost[n] / (self.share * step_s)))) if step_s else 1
                self.gap[n] = min(2 * self.gap[n], cap)
                self.wait[n] = self.gap[n] - 1
