"""Draft sources. A model drafter (layerskip.LayerSkipDraft; swiftk.moa's) proposes levels of candidates from
model passes; a free source (base.FreeSource) proposes chains (a tree) from a lookup. Both learn from what the verify
pass accepts. The built-in free sources are listed in ``FREE``: adding one is a new module here plus one line.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .base import Chain, Context, Estimates, FreeSource, best_first, useful  # noqa: F401
from .context import ContextNgrams
from .corpus import CorpusNgrams
from .datastore import Datastore
from .history import SessionHistory
from .recycle import TokenRecycling
from .user import UserProposer  # noqa: F401

# name -> (its DecodeConfig switch, its class, how one call makes it: (state, estimates, vocab_size, corpus) ->
# source, or None when it has nothing to propose this call). Estimates come from the learned state when the class
# carries them; ``corpus`` is the corpus tables (datastore.CorpusTables.get), asked for only when switched on.
FREE = {
    "ngram": ("ngram", ContextNgrams, lambda state, est, vocab, corpus: ContextNgrams(est)),
    "history": ("history", SessionHistory,
                lambda state, est, vocab, corpus: SessionHistory(state.history, est) if len(state.history) else None),
    "recycle": ("recycle", TokenRecycling,
                lambda state, est, vocab, corpus: TokenRecycling(state.successors(vocab), est)),
    "datastore": ("datastore", CorpusNgrams, lambda state, est, vocab, corpus: CorpusNgrams(corpus(), est)),
}


def free_sources(state, cfg, vocab_size: int, corpus: Callable[[], Datastore], user: Sequence = ()) -> list:
    """The free sources of one call, in tree order: the built-in ones its options switch on, then ``user``'s
    objects (UserProposer)."""
    out = []
    for name, (opt, cls, make) in FREE.items():
        if getattr(cfg, opt):
            src = make(state, state.source_estimates(name, cls.new_estimates) if cls.carries else None, vocab_size,
                       corpus)
            if src is not None:
                out.append(src)
    taken = {"root", "draft", *FREE}
    for p in user:   # each source's outcomes go back to it by name: names are made unique ("Name#2")
        src = UserProposer(p, vocab_size)
        base, k = src.name, 1
        while src.name in taken:
            k += 1
            src.name = f"{base}#{k}"
        taken.add(src.name)
        out.append(src)
    return out
