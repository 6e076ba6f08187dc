"""Reduced-vocabulary draft head: the draft scores only a frequent subset of the vocabulary.

For a small model the LM head is a large share of a draft step (SmolLM2-135M: 49152 x 576 of a 135M-
parameter model, read once per token). Drafts only need to be right on likely tokens, so the draft pass
multiplies by a [n, D] copy of the head rows of a subset (the idea of FR-Spec / EAGLE-3's draft
vocabulary). Verification still uses the full head, so output is unchanged; a token outside the subset
just cannot be drafted. The subset = frequent tokens + every token of the current prompt and output.

How the frequent tokens are ranked (`frequent_token_ids`), with no download and the same on every machine
that has the same Python:

1. Code: count token ids over a fixed corpus, the top-level ``*.py`` modules of the Python standard library
   (``sysconfig.get_paths()["stdlib"]``, sorted by name, the first 32 KiB of each file, about 3 MB in all;
   a few seconds to tokenize). Rank ids by count (ties by lower id).
2. Text: the tokenizer itself is the prior. BPE vocabularies are numbered in merge order, and early merges are
   the frequent pairs, so lower ids are roughly more frequent (bytes and pieces like "Ġthe", "in", "er").
3. Merge: the bos / eos / special ids, then every corpus id by count, then the lowest ids not yet taken.
   The stdlib's docstrings and comments are English too, so the corpus ranking also covers text well
   (coverage figures: docs/design.md).

Step 1 is cached per model under ``$SWIFTK_HOME/draft_vocab/<model_name>.json`` with a fingerprint of the
tokenizer and corpus; a missing, corrupt or stale file is rebuilt.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

import torch

from ..atomic import write_json_atomic
from ..errors import SwiftkError, warn
from ..files import read_json
from ..runtime.model import BlockWeight, QWeight, linear, nbytes
from ..home import swiftk_home
from ..target import Target
from .stdlib import head_corpus_files as _corpus_files, head_corpus_texts as _corpus_texts

_RECIPE = 1  # bump when the corpus or counting changes, to invalidate caches


def _fingerprint(tokenizer) -> str:
    """Changes when the tokenizer or the corpus would give different counts."""
    probe = "def main(argv):\n    return {'x': 1} # The quick brown fox, 2024. héllo 日本"
    h = hashlib.sha256()
    h.update(repr((_RECIPE, sys.version_info[:2], len(_corpus_files()), _vocab_size(tokenizer))).encode())
    h.update(repr(tokenizer.encode(probe, add_bos=False)).encode())
    return h.hexdigest()[:16]


def _vocab_size(tokenizer) -> int:
    return int(getattr(tokenizer, "vocab_size"))


def _corpus_ranking(tokenizer) -> list[int]:
    counts: Counter = Counter()
    for text in _corpus_texts():
        counts.update(tokenizer.encode(text, add_bos=False))
    return [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def _cached_corpus_ranking(tokenizer, cache_dir, model_name: str) -> list[int]:
    V = _vocab_size(tokenizer)
    fp = _fingerprint(tokenizer)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name) or "tokenizer"
    path = Path(cache_dir if cache_dir is not None else swiftk_home()) / "draft_vocab" / f"{name}.json"
    if os.path.lexists(path):
        why = None
        try:
            data = read_json(path, "draft vocabulary")
            ids = data["ids"]
            if data["fingerprint"] != fp:
                why = "made for another tokenizer"
            elif not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < V for i in ids):
                why = f"its ids are not {V} vocabulary ids"
            else:
                return ids
        except (OSError, ValueError, KeyError, TypeError, SwiftkError) as e:
            why = f"{type(e).__name__}: {str(e)[:200]}"
        warn(f"swiftk: rebuilding the draft vocabulary {path}: {why}")
    ids = _corpus_ranking(tokenizer)
    try:
        write_json_atomic(path, {"fingerprint": fp, "ids": ids})
    except OSError:
        pass  # a read-only cache only costs the recount next time
    return ids


def frequent_token_ids(tokenizer, size: int, *, cache_dir=None, model_name: str = "") -> torch.Tensor:
    """The `size` most useful draft ids (long tensor, distinct, most important first); see the module docstring."""
    V = _vocab_size(tokenizer)
    if not 0 < size <= V:
        raise SwiftkError(f"draft vocabulary size must be in 1..{V}, got {size}")
    must = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
    must += sorted(tokenizer.eos_ids) + sorted(getattr(tokenizer, "special_ids", ()))
    ranked = itertools.chain(must, _cached_corpus_ranking(tokenizer, cache_dir, model_name), range(V))
    out = list(itertools.islice(dict.fromkeys(int(i) for i in ranked), size))  # dict: dedupe, keep order
    return torch.tensor(out, dtype=torch.long)


class DraftHead:
    """Rows of the LM head for a growing subset of token ids, kept contiguous for one small matmul."""

    def __init__(self, lm_head: torch.Tensor, base_ids: torch.Tensor, capacity: int):
        V, D = lm_head.shape
        self.lm_head = lm_head  # the model's own tensor (no copy); rows are gathered from it on add()
        self.vocab_size = V
        # Preallocated once: add() fills the next free slots, so the subset weight stays one contiguous
        # prefix [:n] and the draft matmul never sees a reallocated or fragmented tensor.
        quant = isinstance(lm_head, QWeight)
        # a block-format head keeps its rows' raw blocks: [capacity, bytes per row] uint8 of its one format
        self._blocks = lm_head.parts[0][1] if isinstance(lm_head, BlockWeight) else None
        if self._blocks is not None:
            self._w = torch.empty((capacity, lm_head.parts[0][0].shape[1]), dtype=torch.uint8)
        else:
            self._w = torch.empty((capacity, D), dtype=lm_head.q.dtype if quant else lm_head.dtype,
                                  device=lm_head.device)
        self._s = torch.empty(capacity, dtype=torch.float32, device=lm_head.device) if quant else None
        self._ids = torch.empty(capacity, dtype=torch.long, device=lm_head.device)
        # Membership on the host: add() runs every round, and on a GPU a device-side test would be several
        # launches and syncs for (usually) nothing new.
        self._members: set = set()
        self._n = 0
        self.add(base_ids)

    @property
    def capacity(self) -> int:
        return self._w.shape[0]

    def copy(self, n: int) -> "DraftHead":
        """A head of its own holding this one's first ``n`` ids (the base set): calls decoding together each grow
        their own context rows."""
        other = DraftHead.__new__(DraftHead)
        other.lm_head, other.vocab_size, other._blocks = self.lm_head, self.vocab_size, self._blocks
        other._w, other._ids = self._w.clone(), self._ids.clone()
        other._s = None if self._s is None else self._s.clone()
        other._n = max(0, min(n, self._n))
        other._members = set(other._ids[:other._n].tolist())
        return other

    def __len__(self) -> int:
        return self._n

    def add(self, token_ids) -> None:
        """Make sure these ids are in the subset; ids already there are ignored."""
        ids = token_ids.reshape(-1).tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        fresh = sorted({int(i) for i in ids} - self._members)   # a set: an id repeated in one call takes one slot
        if not fresh:
            return
        if fresh[0] < 0 or fresh[-1] >= self.vocab_size:
            raise SwiftkError(f"token id out of range 0..{self.vocab_size - 1}")
        m = len(fresh)
        if self._n + m > self.capacity:
            raise SwiftkError(
                f"draft vocabulary is full: {self._n} ids + {m} new > capacity {self.capacity}; "
                "create the DraftHead with a larger capacity"
            )
        new = torch.tensor(fresh, dtype=torch.long, device=self._ids.device)
        rows = self.lm_head[new]
        if self._blocks is not None:
            self._w[self._n : self._n + m] = rows.parts[0][0]
        elif self._s is not None:
            self._w[self._n : self._n + m], self._s[self._n : self._n + m] = rows.q, rows.scale
        else:
            self._w[self._n : self._n + m] = rows
        self._ids[self._n : self._n + m] = new
        self._members.update(fresh)
        self._n += m

    @property
    def ids(self) -> torch.Tensor:
        return self._ids[: self._n]

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` ids (e.g. the frequent base set) and forget the rest (the last call's context)."""
        n = max(0, min(n, self._n))
        self._members.difference_update(self._ids[n : self._n].tolist())
        self._n = n

    @property
    def weight_bytes(self) -> int:
        """Bytes one draft step reads from this head."""
        return self._n * (self._w.shape[1] * self._w.element_size() + (4 if self._s is not None else 0))

    def logits_subset(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> float32 [T, n]: the full head's logits at `ids`, in that order."""
        if self._blocks is not None:
            w = BlockWeight(((self._w[: self._n], self._blocks),), self.lm_head.K)   # rows in the file's layout: float32
        else:
            w = self._w[: self._n] if self._s is None else QWeight(self._w[: self._n], self._s[: self._n])
        return linear(x, w).float()

    def logits_full(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> float32 [T, V], -inf outside the subset (the draft gives those tokens zero probability)."""
        out = torch.full((x.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32, device=x.device)
        out[:, self.ids] = self.logits_subset(x)
        return out

    def nbytes(self) -> int:
        return sum(nbytes(t) for t in (self._w, self._ids) + ((self._s,) if self._s is not None else ()))


def target_draft_head(target: Target, size: int, slot: int = 0) -> Optional[DraftHead]:
    """The target's draft head of ``size`` base tokens for the calls on batch slot ``slot``, built once (kept as
    its ("draft_head", size, slot) resource: slot 0's from the vocabulary, the others copies of it) and reset for a
    new call; None when a subset would not be much smaller than the vocabulary (or ``size`` is 0)."""
    if not 0 < size < target.config.vocab_size // 2:
        return None

    def make():
        base = frequent_token_ids(target.tokenizer, size, cache_dir=swiftk_home() / "draft_vocab",
                                  model_name=target.name)
        return len(base), DraftHead(target.model.lm_head, base.to(target.device), len(base) + target.max_context + 64)

    n_base, first = target.resource(("draft_head", size, 0), make)
    head = first if not slot else target.resource(("draft_head", size, slot), lambda: first.copy(n_base))
    head.truncate(n_base)
    return head
