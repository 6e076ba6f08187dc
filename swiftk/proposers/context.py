"""Context n-grams (prompt lookup): the continuation of the sequence's last 1-4 tokens where they occurred before
in the same text. Code edits, summaries and chat about a given text repeat long spans of it."""
from __future__ import annotations

from typing import Optional

from ..ngram import NgramIndex
from .base import Chain, Context, FreeSource


class ContextNgrams(FreeSource):
    name = "ngram"
    # per match length n (0..4): a longer match repeats more reliably. A weak prior, 2 observations: one or two
    # misses move it past a CPU verify pass's break-even, so text that never repeats stops paying within a prompt
    prior = tuple(min(0.5, 0.1 + 0.1 * n) for n in range(5))
    carries = False   # whether a text repeats itself is a property of that text: fresh estimates per call

    def __init__(self, estimates=None):
        super().__init__(estimates)
        self.index = NgramIndex([])

    def propose(self, ctx: Context) -> Optional[Chain]:
        self.index.extend(ctx.tokens[len(self.index):])   # the index ends with the root, like the sequence
        props = self.index.propose(ctx.k)
        return self.chain(props[0].tokens, props[0].n, ctx) if props else None
