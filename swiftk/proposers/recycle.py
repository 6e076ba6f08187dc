"""Token Recycling (Luo et al., ACL 2025): the target's own top-k candidates, recycled as drafts.

Every verify pass and plain step already computes the target's next-token scores after each token it reads. Keeping
the top ``K`` of them per input token in a successor table (``[vocab, K]`` int32: 1.5 MiB for a 49k vocabulary, 4.6
MiB for 152k) gives, for any token, what the model last wanted after it -- context-free, but often right on
boilerplate the text itself has not shown yet (indentation, closing brackets, common words after common words). A
draft is a tree walked through the table from the root, best-first by learned (depth, rank) estimates.
"""
from __future__ import annotations

import threading
import torch

from ..runtime.ops.cpu_topk import topk_into
from .base import Context, FreeSource, best_first

K = 8          # candidates kept per token
_DEPTHS = 4    # estimate keys: depth 1, 2, 3, 4+ ...
_WIDTH = 3     # ... times rank 0..K-1; children tried per node
MAX_NODES = 16
_RANK = (0.3, 0.1, 0.05, 0.03, 0.02, 0.02, 0.01, 0.01)


class SuccessorTable:
    """token -> the target's top-K next tokens the last time it read that token (-1: never read). One learned
    state's; updated in place from the logits of committed positions."""

    def __init__(self, vocab: int):
        self.table = torch.full((vocab, K), -1, dtype=torch.int32)   # [V, K]
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def update(self, tokens: list, logits: torch.Tensor, rows: list) -> None:
        """``tokens[i]`` was read and row ``rows[i]`` of ``logits`` [N, V] scored the next position."""
        with self.lock:   # rows read in place on CPU: no copy of 3-16 x 0.2-0.6 MB a round
            topk_into(logits.detach(), list(rows), self.table, list(tokens))

    def put(self, tokens: torch.Tensor, top: torch.Tensor) -> None:
        """Set the rows of ``tokens`` [n] to ``top`` [n, K] (top-k computed elsewhere: replays, tests)."""
        with self.lock:
            self.table[tokens.long()] = top.to(torch.int32)

    def row(self, token: int) -> list:
        return self.table[token].tolist()


class TokenRecycling(FreeSource):
    name = "recycle"
    prior = tuple(r * (0.9 ** d) for d in range(_DEPTHS) for r in _RANK)
    carries = True   # how often the model repeats its own top-k is the model's, not one text's
    learns = True    # wants the logits of committed positions (learn)

    def __init__(self, table: SuccessorTable, estimates=None):
        super().__init__(estimates)
        self.succ = table

    def learn(self, tokens: list, logits: torch.Tensor, rows: list) -> None:
        self.succ.update(tokens, logits, rows)

    def propose(self, ctx: Context) -> list:
        est, rows = self.est, {}

        def expand(tok: int, depth: int) -> list:
            row = rows.get(tok)
            if row is None:
                row = rows[tok] = self.succ.row(tok)
            out = []
            for rank, nxt in enumerate(row[:_WIDTH]):
                if nxt < 0:
                    break
                key = min(depth, _DEPTHS - 1) * K + rank
                out.append((nxt, nxt, est.prob(key), key))
            return out

        return best_first(ctx.tokens[-1], expand, min(MAX_NODES, 2 * ctx.k), ctx.k, ctx.floor, self.name)
