"""Prompt-lookup drafting: guess the next tokens by finding the current suffix earlier in the context.

Code edits, summaries and chat about a given text repeat long spans of the context. If the last n
tokens occurred before, the tokens that followed that occurrence are a free draft (no model call).

`NgramIndex` keeps, for every n-gram (min_n <= n <= max_n) of the sequence, the positions where it
ends. Appending a token adds at most max_n entries, so the index grows with the text and is never
rebuilt. `propose` looks up the last max_n, max_n - 1, ... tokens and copies what followed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from .errors import SwiftkError


@dataclass
class NgramDraft:
    tokens: list[int]  # the proposed continuation, 1..k tokens
    n: int  # length of the suffix that matched
    count: int  # earlier occurrences of the suffix (among those kept) followed by tokens[0]


class NgramIndex:
    """Incremental index over one token sequence (prompt + generated text)."""

    def __init__(
        self, tokens: Iterable[int] = (), max_n: int = 4, min_n: int = 1, *, max_positions: int = 8, cyclic: bool = False
    ):
        if not 1 <= min_n <= max_n:
            raise SwiftkError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_positions < 2:
            # One slot always holds the current suffix itself, which is never a usable match.
            raise SwiftkError(f"max_positions must be >= 2, got {max_positions}")
        self.max_n, self.min_n, self.max_positions = max_n, min_n, max_positions
        self.cyclic = cyclic  # see _copy
        self.tokens: list[int] = []
        # n-gram tuple -> end positions (index of its last token), most recent last, at most max_positions:
        # that bounds memory and lookup cost on repetitive text; the most recent occurrences are the best guesses.
        # (Plain lists: most n-grams occur once, and a deque costs ~600 bytes even then.)
        self._ends: dict[tuple, list] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        """Append committed tokens and index the n-grams that end at each of them."""
        seq, ends = self.tokens, self._ends
        for t in tokens:
            seq.append(int(t))
            i = len(seq) - 1
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                key = tuple(seq[i - n + 1 : i + 1])
                d = ends.get(key)
                if d is None:
                    ends[key] = [i]
                else:
                    d.append(i)
                    if len(d) > self.max_positions:
                        del d[0]

    def propose(self, k: int, branches: int = 1) -> list[NgramDraft]:
        """Up to `branches` drafts of at most k tokens, with distinct first tokens; longest match, most recent first."""
        seq = self.tokens
        L = len(seq)
        if k <= 0 or branches <= 0 or L < 2:
            return []
        last = L - 1
        drafts: list[NgramDraft] = []
        taken: set[int] = set()  # first tokens already proposed
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            ends = self._ends.get(tuple(seq[L - n :]))
            if not ends:
                continue
            # first token -> (most recent end position, how many occurrences it follows); dicts keep
            # insertion order, and we walk from the most recent occurrence back.
            found: dict[int, list[int]] = {}
            for p in reversed(ends):
                if p >= last:  # the suffix itself: nothing follows it yet
                    continue
                first = seq[p + 1]
                if first in found:
                    found[first][1] += 1
                else:
                    found[first] = [p, 1]
            for first, (p, count) in found.items():
                if first in taken:
                    continue
                taken.add(first)
                drafts.append(NgramDraft(self._copy(p + 1, k), n, count))
                if len(drafts) == branches:
                    return drafts
        return drafts

    def lookup(self, suffix: list, k: int, stop: Optional[int] = None) -> Optional[NgramDraft]:
        """The continuation in this index of the longest suffix of ``suffix`` (another text's tail): up to k tokens
        after its most recent occurrence, cut before ``stop`` (a document separator). None when nothing follows."""
        L = len(self.tokens)
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            ends = self._ends.get(tuple(suffix[len(suffix) - n:]))
            if not ends:
                continue
            for p in reversed(ends):
                out = []
                for t in self.tokens[p + 1: min(L, p + 1 + k)]:
                    if t == stop:
                        break
                    out.append(t)
                if out:
                    return NgramDraft(out, n, sum(1 for q in ends if q + 1 < L and self.tokens[q + 1] == out[0]))
        return None

    def _copy(self, start: int, k: int) -> list[int]:
        """Up to k tokens from `start`; a match close to the end gives a short draft (it stops at the end).

        With cyclic=True the copy goes on LZ77-style past the end, reading the draft itself: a match that
        overlaps the suffix then continues the repeating pattern, e.g. `a b a b a` with suffix `b a` ->
        `b a b a ...` rather than `b a`. Useful on loops and runs; off by default (drafts stay literal copies).
        """
        seq, L = self.tokens, len(self.tokens)
        if not self.cyclic:
            return seq[start : start + k]
        out: list[int] = []
        for j in range(k):
            src = start + j
            out.append(seq[src] if src < L else out[src - L])
        return out


SEPARATOR = -1   # between two outputs in an OutputHistory: no n-gram continues across it


class OutputHistory:
    """The model's earlier outputs (one learned state's), an n-gram source across prompts.

    A model repeats itself from answer to answer -- Qwen2.5-Coder ends many HumanEval completions with
    ``# Check function to verify the correctness of the solution`` and a ``check_solution`` of asserts, chat models
    open and close answers alike -- so the continuation of the current suffix in what it generated before is a
    free draft where the current context has none (the idea of SuffixDecoding, Oliaro et al. 2024, with an n-gram
    index instead of a suffix tree). Kept in memory only (user outputs are never written to disk), at most
    ``max_tokens``: past that, the older half is dropped.
    """

    def __init__(self, max_tokens: int = 32768, max_n: int = 4):
        if max_tokens < 2:
            raise SwiftkError(f"max_tokens must be >= 2, got {max_tokens}")
        self.max_tokens, self.max_n = max_tokens, max_n
        self.index = NgramIndex([], max_n=max_n)
        self.outputs = 0

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
            self.index = NgramIndex(old[start:], max_n=self.max_n)
        self.index.extend(tokens + [SEPARATOR])
        self.outputs += 1

    def propose(self, context: list, k: int) -> Optional[NgramDraft]:
        """What followed the longest suffix (<= max_n tokens) of ``context`` most recently in earlier outputs."""
        if k <= 0 or not len(self.index):
            return None
        return self.index.lookup(context[-self.max_n:], k, stop=SEPARATOR)
