"""Corpus n-grams: the most frequent continuation of the sequence's last 1-3 tokens in a fixed corpus
(datastore.py: tables over the Python standard library's source). Estimates per (match length, share of the
n-gram's occurrences the proposed token followed)."""
from __future__ import annotations

from typing import Optional

from .datastore import CONF_BINS, MAX_N, N_BUCKETS, Datastore
from .base import Chain, Context, FreeSource

_MIDS = [(lo + hi) / 2 for lo, hi in zip((0.0, *CONF_BINS), (*CONF_BINS, 1.0))]


class CorpusNgrams(FreeSource):
    name = "datastore"
    # half the share bin's middle, times 0.8 / 1.0 / 1.2 for n = 1 / 2 / 3
    prior = tuple(0.5 * _MIDS[b % len(_MIDS)] * (0.8 + 0.2 * (b // len(_MIDS))) for b in range(N_BUCKETS))
    carries = True    # how well the corpus fits is a property of the traffic (code or prose)

    def __init__(self, datastore: Datastore, estimates=None):
        super().__init__(estimates)
        self.ds = datastore

    def propose(self, ctx: Context) -> Optional[Chain]:
        probs = self.est.probs()
        toks, buckets = self.ds.propose(ctx.tokens[-MAX_N:], ctx.k, floor=ctx.floor, probs=probs)
        if not toks:
            return None
        return Chain(toks, [probs[b] for b in buckets], self.name, buckets)
