"""A draft source written outside swiftk: any object with ``propose(tokens) -> list[int]`` (the proposed
continuation of ``tokens``, possibly empty), passed as ``eng.generate(prompt, proposers=[obj])``.

It is priced and gated like the built-in free sources: its estimate (the chance a proposed token is accepted when
its parent was, one figure for every depth, fresh each call) learns from what the target accepts, and once it
falls below what a verify pass costs, its proposals are verified only as rare probes. Output stays the target's:
every proposed token is verified.
"""
from __future__ import annotations

import operator
from typing import Optional

from ..errors import SwiftkError
from .base import Chain, Context, FreeSource


class UserProposer(FreeSource):
    # one key for every depth: a chain of estimate p is worth p, p^2, ... (per-depth keys would each need their
    # own verified tries before a deep token could ever pay)
    prior = (0.3,)
    carries = False

    def __init__(self, obj, vocab_size: int, name: Optional[str] = None):
        super().__init__()
        self.obj, self.vocab_size = obj, vocab_size
        self.name = name or getattr(obj, "name", None) or type(obj).__name__

    @staticmethod
    def check(obj) -> None:
        if not callable(getattr(obj, "propose", None)):
            raise SwiftkError(f"a proposer needs a propose(tokens) -> list[int] method; {type(obj).__name__} "
                              "has none")

    def propose(self, ctx: Context) -> Optional[Chain]:
        try:
            out = self.obj.propose(list(ctx.tokens))   # a copy: the proposer cannot change the sequence
        except Exception as e:   # noqa: BLE001 - a user's bug surfaces as ours, named
            raise SwiftkError(f"proposer {self.name!r} raised {type(e).__name__}: {e}") from e
        if out is None:
            return None
        toks = _token_ids(out, ctx.k)
        if toks is None or any(not 0 <= t < self.vocab_size for t in toks):
            raise SwiftkError(f"proposer {self.name!r} must return a list of token ids in [0, {self.vocab_size}), "
                              f"got {str(out)[:80]}")
        if not toks:
            return None
        return self.chain(toks, 0, ctx)


def _token_ids(out, k: int) -> Optional[list]:
    """The first k items of ``out`` as ints (ints, numpy ints, 0-d tensors), or None if any is not one (floats,
    bools and strings are not token ids)."""
    try:
        items = list(out[:k])
    except TypeError:
        return None
    ids = []
    for t in items:
        if isinstance(t, bool):
            return None
        try:
            ids.append(operator.index(t))
        except TypeError:
            return None
    return ids


def check_proposers(proposers, method, rejection: bool) -> list:
    """The ``proposers=`` argument of generate, checked: a list of objects with ``propose``, given to a method
    that drafts, under a sampling rule that can verify deterministic proposals."""
    if proposers is None:
        return []
    if not isinstance(proposers, (list, tuple)):
        raise SwiftkError(f"proposers must be a list of objects with propose(tokens), got {type(proposers).__name__}")
    for p in proposers:
        UserProposer.check(p)
    if proposers and not method.speculative:
        raise SwiftkError(f"method={method.name!r} decodes without drafts: it takes no proposers")
    if proposers and rejection:
        raise SwiftkError("sampling='rejection' has no rule for deterministic proposals: use the default "
                          "sampling='coupled' with proposers")
    return list(proposers)
