"""The session's earlier outputs: the continuation of the sequence's tail in what the model generated for
earlier prompts (SuffixDecoding's idea, with an n-gram index). A model repeats itself from answer to answer --
closing lines, test scaffolds, greetings."""
from __future__ import annotations

from typing import Optional

from ..ngram import OutputHistory
from .base import Chain, Context, FreeSource


class SessionHistory(FreeSource):
    name = "history"
    prior = tuple(min(0.4, 0.1 * max(n, 1)) for n in range(5))   # per match length
    carries = True    # how much a model repeats itself across answers belongs to the traffic, not to one text

    def __init__(self, history: OutputHistory, estimates=None):
        super().__init__(estimates)
        self.history = history

    def propose(self, ctx: Context) -> Optional[Chain]:
        hp = self.history.propose(ctx.tokens[-self.history.max_n:], ctx.k)
        return self.chain(hp.tokens, hp.n, ctx) if hp is not None else None
