"""What every draft source shares: the chain it proposes, the acceptance estimates it learns, the protocol.

A *free* source (no model pass: context n-grams, the session's earlier outputs, a corpus, a user object) implements

    propose(ctx: Context) -> Chain | None     # a continuation of ctx.tokens (whose last token is the tree's root)
    observe(key, hit)                         # node ``key`` of an earlier chain was (not) accepted, its parent was

and owns an :class:`Estimates` table: per key (match length, depth, ...) the chance that a proposed token is
accepted given its parent was. The tree builder prices every node with it, the gate keeps the nodes that pay for
their share of the verify pass, and the loop feeds the outcome back. A source whose estimates should outlive one
call (``carries = True``) keeps them in the learned state, which persists them; the others start fresh per call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import SwiftkError
from ..tree import Chain  # noqa: F401  (re-exported: what a source proposes)


@dataclass
class Context:
    """What a free source sees each round: the sequence so far (prompt + emitted tokens, the last one being the
    tree's root, not yet in the KV cache), how many tokens a chain may hold, and the estimate below which a
    token is not worth building (the gate's floor)."""

    tokens: list
    k: int
    floor: float


class Estimates:
    """Acceptance chance per key, as (hits, tries) with exponential forgetting, starting from ``prior`` counted as
    ``weight`` observations. Free sources forget fast (``decay`` 0.9: whether text repeats changes within a
    prompt); the layer-skip calibration slowly (0.99)."""

    def __init__(self, prior: Sequence[float], weight: float = 2.0, decay: float = 0.9):
        self.hits = [weight * p for p in prior]
        self.tries = [float(weight)] * len(prior)
        self.decay = decay

    def __len__(self) -> int:
        return len(self.hits)

    def prob(self, key: int) -> float:
        i = min(max(int(key), 0), len(self.hits) - 1)
        return self.hits[i] / self.tries[i]

    def observe(self, key: int, hit: bool) -> None:
        i = min(max(int(key), 0), len(self.hits) - 1)
        self.hits[i] = self.decay * self.hits[i] + bool(hit)
        self.tries[i] = self.decay * self.tries[i] + 1

    def to_dict(self) -> dict:
        return {"hits": list(self.hits), "tries": list(self.tries)}

    def load_dict(self, d: dict) -> None:
        """Take saved counts of the same shape; a SwiftkError names what does not fit."""
        hits, tries = [float(x) for x in d["hits"]], [float(x) for x in d["tries"]]
        if len(hits) != len(self.hits) or len(tries) != len(self.tries):
            raise SwiftkError(f"estimates have {len(hits)} keys, expected {len(self.hits)}")
        if not all(math.isfinite(h) and math.isfinite(t) and 0 <= h <= t < 1e6 and t > 0
                   for h, t in zip(hits, tries)):
            raise SwiftkError("estimates hold counts out of range")
        self.hits, self.tries = hits, tries


class FreeSource:
    """Base of the sources that cost no model pass. Subclasses set ``name``, ``prior`` (the estimate per key
    before any observation) and ``carries``, and implement ``propose``."""

    name = "free"
    prior: Sequence[float] = (0.3,)
    carries = False

    def __init__(self, estimates: Optional[Estimates] = None):
        self.est = estimates if estimates is not None else self.new_estimates()

    @classmethod
    def new_estimates(cls) -> Estimates:
        return Estimates(cls.prior)

    def propose(self, ctx: Context) -> Optional[Chain]:
        raise NotImplementedError

    def observe(self, key: int, hit: bool) -> None:
        self.est.observe(key, hit)

    def chain(self, tokens: list, key: int, ctx: Context) -> Optional[Chain]:
        """``tokens`` all filed under one key, cut where they stop paying (see :func:`useful`)."""
        p = self.est.prob(key)
        n = useful(p, min(ctx.k, len(tokens)), ctx.floor)
        return Chain(tokens[:n], [p] * n, self.name, [key] * n) if n else None


def useful(p: float, k: int, floor: float) -> int:
    """Tokens of a chain whose every token is accepted with chance p (given its parent) worth building: the d with
    p^d >= floor (at most k), and always the first -- the gate's probes verify a declined chain's first token now
    and then, which is how an estimate that fell below the floor learns that the text changed."""
    if floor <= 0.0 or p >= 1.0:
        return k
    if p <= 0.0:
        return min(k, 1)
    return max(min(k, 1), min(k, int(math.log(floor) / math.log(p) + 1e-9)))
