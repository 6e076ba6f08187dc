"""Suffix automaton over a token sequence: the one structure behind the context and history drafts.

A draft that costs no model pass guesses the next tokens from what followed the sequence's current tail where that
tail occurred before (prompt lookup; SuffixDecoding, Oliaro et al. 2024, over earlier outputs). A suffix automaton
(Blumer et al. 1985) answers that for tails of any length, not just n <= 4: its states are the classes of
substrings with the same end positions, so

- the longest suffix of the sequence that also occurred earlier is the suffix link of the last state;
- the longest suffix of *another* sequence found here is a walk (:class:`Matcher`), one step per token;
- the transitions out of a state are exactly the tokens that followed its substring, and ``count[t]`` (how many
  end positions state t has) how often each did: a continuation tree with frequencies, of unbounded depth.

Appending a token adds at most two states (amortised O(1) transitions); counts and most recent end positions are
propagated up the suffix-link chain, at most ``_WALK`` states (beyond that, on long runs of one repeated token,
short substrings' counts stop growing: they only rank siblings, and those are still ordered by recency).
Memory is two states per token at most (a few hundred bytes each in Python); callers bound the sequence.
"""
from __future__ import annotations

from typing import Iterable

from ..errors import SwiftkError

SEPARATOR = -1   # between two outputs in an OutputHistory: no continuation runs across it
_WALK = 64       # suffix-link states whose count/recency an append updates


class SuffixIndex:
    """Incremental suffix automaton over one sequence. State 0 is the root (the empty string)."""

    def __init__(self, tokens: Iterable[int] = ()):
        self.tokens: list = []
        self.length = [0]     # per state: its longest substring's length
        self.link = [-1]      # per state: the state of its longest suffix with more end positions
        self.next = [{}]      # per state: token -> state
        self.count = [0]      # per state: how many end positions (occurrences), capped walk (see module doc)
        self.last_end = [-1]  # per state: its most recent end position
        self.last = 0         # the state of the whole sequence
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_states(self) -> int:
        return len(self.length)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self._append(int(t))

    def _new(self, length: int, link: int, nxt: dict, count: int, end: int) -> int:
        self.length.append(length)
        self.link.append(link)
        self.next.append(nxt)
        self.count.append(count)
        self.last_end.append(end)
        return len(self.length) - 1

    def _append(self, c: int) -> None:
        pos = len(self.tokens)
        self.tokens.append(c)
        length, link, nxt = self.length, self.link, self.next
        cur = self._new(length[self.last] + 1, 0, {}, 0, pos)
        p = self.last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:   # q also holds longer strings that do not end here: split off the part that does
                clone = self._new(length[p] + 1, link[q], dict(nxt[q]), self.count[q], self.last_end[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        s, steps = cur, 0   # position ``pos`` is a new end of cur and of every suffix-link ancestor
        while s > 0 and steps < _WALK:
            self.count[s] += 1
            self.last_end[s] = pos
            s, steps = link[s], steps + 1

    def repeat(self) -> tuple:
        """(state, length) of the longest suffix of the sequence that also ended earlier; (0, 0) if none."""
        if not self.tokens:
            return 0, 0
        s = self.link[self.last]
        return s, self.length[s]

    def children(self, state: int) -> list:
        """(token, child state, count) of what followed ``state``'s substring, most frequent first, then most
        recent; separators left out."""
        out = [(t, s, self.count[s]) for t, s in self.next[state].items() if t != SEPARATOR]
        out.sort(key=lambda x: (-x[2], -self.last_end[x[1]]))
        return out


class Matcher:
    """The longest suffix of a growing sequence (fed token by token) that occurs in a :class:`SuffixIndex` built
    from another one: a walk down transitions, falling back along suffix links on a mismatch."""

    def __init__(self, index: SuffixIndex):
        self.index, self.state, self.matched, self.fed = index, 0, 0, 0

    def feed(self, tokens: Iterable[int]) -> None:
        ix = self.index
        for t in tokens:
            self.fed += 1
            t = int(t)
            while self.state and t not in ix.next[self.state]:
                self.state = ix.link[self.state]
                self.matched = ix.length[self.state]
            if t in ix.next[self.state]:
                self.state = ix.next[self.state][t]
                self.matched += 1
            else:
                self.state, self.matched = 0, 0


class OutputHistory:
    """The model's earlier outputs (one learned state's), a draft source across prompts.

    A model repeats itself from answer to answer -- Qwen2.5-Coder ends many HumanEval completions with
    ``# Check function to verify the correctness of the solution`` and a ``check_solution`` of asserts, chat models
    open and close answers alike. Kept in memory only (user outputs are never written to disk), at most
    ``max_tokens``: past that, the older half is dropped and the automaton rebuilt.
    """

    def __init__(self, max_tokens: int = 32768):
        if max_tokens < 2:
            raise SwiftkError(f"max_tokens must be >= 2, got {max_tokens}")
        self.max_tokens = max_tokens
        self.index = SuffixIndex()
        self.outputs = 0
        self.version = 0   # bumped when the automaton is rebuilt: matchers over the old one are stale

    def __len__(self) -> int:
        return len(self.index)

    def add(self, tokens: list) -> None:
        """Append one finished output."""
        tokens = [int(t) for t in tokens][-(self.max_tokens - 1):]
        if not tokens:
            return
        if len(self.index) + len(tokens) + 1 > self.max_tokens:   # keep at most half the bound of the old text
            room = min(self.max_tokens // 2, self.max_tokens - len(tokens) - 1)
            old = self.index.tokens[len(self.index) - room:] if room > 0 else []
            start = old.index(SEPARATOR) + 1 if SEPARATOR in old else len(old)   # whole outputs only
            self.index = SuffixIndex(old[start:])
            self.version += 1
        self.index.extend(tokens + [SEPARATOR])
        self.outputs += 1
