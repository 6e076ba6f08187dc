"""Context drafts: the continuation of the sequence's tail where that tail occurred before in the same text (prompt
lookup, generalised). Code edits, summaries and chat about a given text repeat long spans of it.

The text lives in a suffix automaton (swiftk/proposers/suffix.py), so the match is the longest earlier occurrence of the tail
at any length, and what followed it comes with counts: a tree whose branches are ranked by how often each
continuation occurred, deeper and wider where the match is long and the continuation consistent. Each node is
priced by (match length, how consistent its continuation was), learned from what the verify pass accepts.
"""
from __future__ import annotations

from typing import Optional

from .suffix import SuffixIndex
from .base import Context, Estimates, FreeSource, best_first

MATCH_BUCKETS = (1, 2, 3, 4, 6, 9, 16, 32)   # matched tokens: a node's bucket is the last threshold it reaches
_BASE = (0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.72, 0.8)   # prior per match bucket, for a consistent continuation
# per continuation kind: every earlier occurrence (>= 2) continued this way / seen once / a common branch / a rare one
_KIND = (1.15, 1.0, 0.6, 0.25)
_WIDTH = 4       # children tried per node
MAX_NODES = 24   # per source and round; the gate keeps what pays (CPU trees verify 4-16 nodes)


def node_key(matched: int, count: int, total: int) -> int:
    mb = sum(1 for b in MATCH_BUCKETS if matched >= b) - 1
    share = count / total if total else 0.0
    kind = 0 if count >= 2 and share >= 0.8 else 1 if total == 1 else 2 if share >= 0.4 else 3
    return max(mb, 0) * len(_KIND) + kind


class SuffixDraft(FreeSource):
    """What the context and history sources share: pricing nodes of a continuation tree and turning it into
    chains. Subclasses say where the match is (``match``: (index, state, matched length))."""

    prior = tuple(min(0.9, b * k) for b in _BASE for k in _KIND)
    carries = True   # acceptance by (match length, consistency) is the model's and the traffic's, not one text's

    def match(self, ctx: Context) -> Optional[tuple]:
        raise NotImplementedError

    def propose(self, ctx: Context) -> list:
        m = self.match(ctx)
        if m is None:
            return []
        index, state, matched = m
        est, width = self.est, _WIDTH

        def expand(s: int, depth: int) -> list:
            kids = index.children(s)
            total = sum(k[2] for k in kids)   # the share is among all continuations, tried or not
            out = []
            for tok, child, count in kids[:width]:
                key = node_key(matched + depth, count, total)
                out.append((tok, child, est.prob(key), key))
            return out

        return best_first(state, expand, min(MAX_NODES, 2 * ctx.k), ctx.k, ctx.floor, self.name)


class ContextNgrams(SuffixDraft):
    name = "ngram"

    def __init__(self, estimates: Optional[Estimates] = None):
        super().__init__(estimates)
        self.index = SuffixIndex()

    def match(self, ctx: Context) -> Optional[tuple]:
        self.index.extend(ctx.tokens[len(self.index):])   # the index ends with the root, like the sequence
        state, matched = self.index.repeat()
        return (self.index, state, matched) if matched else None
