"""Draft sources. A model drafter (layerskip.LayerSkipDraft; swiftk.moa's) proposes levels of candidates from
model passes; a free source (base.FreeSource) proposes a chain from a lookup. Both learn from what the verify
pass accepts. The built-in free sources are listed in ``FREE``: adding one is a new module here plus one line.
"""
from __future__ import annotations

from .base import Chain, Context, Estimates, FreeSource, useful  # noqa: F401
from .context import ContextNgrams
from .corpus import CorpusNgrams
from .history import SessionHistory
from .user import UserProposer  # noqa: F401

# name -> (its DecodeConfig switch, how one call makes it from the engine and the learned state; None: nothing
# to propose this call)
FREE = {
    "ngram": ("ngram", lambda eng, state: ContextNgrams()),
    "history": ("history", lambda eng, state: SessionHistory(
        state.history, state.source_estimates("history", SessionHistory.new_estimates)) if len(state.history)
        else None),
    "datastore": ("datastore", lambda eng, state: CorpusNgrams(
        eng.corpus(), state.source_estimates("datastore", CorpusNgrams.new_estimates))),
}


def free_sources(engine, state, cfg, user=()) -> list:
    """The free sources of one call, in tree order: the built-in ones its options switch on, then ``user``'s
    objects (UserProposer)."""
    out = [s for s in (make(engine, state) for opt, make in FREE.values() if getattr(cfg, opt)) if s is not None]
    taken = {"root", "draft", *FREE}
    for p in user:   # each source's outcomes go back to it by name: names are made unique ("Name#2")
        src = UserProposer(p, engine.config.vocab_size)
        base, k = src.name, 1
        while src.name in taken:
            k += 1
            src.name = f"{base}#{k}"
        taken.add(src.name)
        out.append(src)
    return out
