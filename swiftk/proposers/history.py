"""The session's earlier outputs: the continuation of the sequence's tail in what the model generated for earlier
prompts (SuffixDecoding's idea). A model repeats itself from answer to answer -- closing lines, test scaffolds,
greetings. Same automaton and pricing as the context source; the match is a walk over the current sequence."""
from __future__ import annotations

from typing import Optional

from .suffix import Matcher, OutputHistory
from .base import Context
from .context import SuffixDraft


class SessionHistory(SuffixDraft):
    name = "history"

    def __init__(self, history: OutputHistory, estimates=None):
        super().__init__(estimates)
        self.history, self.version = history, history.version
        self.matcher = Matcher(history.index)

    def match(self, ctx: Context) -> Optional[tuple]:
        if self.history.version != self.version:   # rebuilt since this call began (another thread's call ended)
            self.version, self.matcher = self.history.version, Matcher(self.history.index)
        m = self.matcher
        m.feed(ctx.tokens[m.fed:])
        return (m.index, m.state, m.matched) if m.matched else None
