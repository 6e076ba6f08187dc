"""Draft sources. A model drafter (layerskip.LayerSkipDraft; swiftk.moa's) proposes levels of candidates from
model passes; a free source (base.FreeSource) proposes chains (a tree) from a lookup. Both learn from what the verify
pass accepts. The built-in free sources are listed in ``FREE``: adding one is a new module here plus one line.
"""
from __future__ import annotations

from .base import Chain, Context, Estimates, FreeSource, best_first, useful  # noqa: F401
from .context import ContextNgrams
from .corpus import CorpusNgrams
from .history import SessionHistory
from .recycle import TokenRecycling
from .user import UserProposer  # noqa: F401

# name -> (its DecodeConfig switch, its class, how one call makes it: (engine, state, estimates) -> source, or None
# when it has nothing to propose this call). Estimates come from the learned state when the class carries them.
FREE = {
    "ngram": ("ngram", ContextNgrams, lambda eng, state, est: ContextNgrams(est)),
    "history": ("history", SessionHistory,
                lambda eng, state, est: SessionHistory(state.history, est) if len(state.history) else None),
    "recycle": ("recycle", TokenRecycling,
                lambda eng, state, est: TokenRecycling(state.successors(eng.config.vocab_size), est)),
    "datastore": ("datastore", CorpusNgrams, lambda eng, state, est: CorpusNgrams(eng.corpus(), est)),
}


def free_sources(engine, state, cfg, user=()) -> list:
    """The free sources of one call, in tree order: the built-in ones its options switch on, then ``user``'s
    objects (UserProposer)."""
    out = []
    for name, (opt, cls, make) in FREE.items():
        if getattr(cfg, opt):
            src = make(engine, state, state.source_estimates(name, cls.new_estimates) if cls.carries else None)
            if src is not None:
                out.append(src)
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
