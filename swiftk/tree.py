"""The verification tree: from per-depth draft candidates to the tensors one target forward needs.

A tree is general (a parent index per node); SWIFT's drafter produces a spine (its top-1 chain) with candidate
siblings hanging off every spine node. Nodes are stored spine first, so when the spine is accepted its KV already
sits in the right slots and the commit copies nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .acceptance import ancestor_matrix
from .model import TreeMask
from .ops.reference import pack_tree_mask

# Candidates per depth chosen from the draft's top-1 probability p: (threshold, k) tried in order, else last k.
GREEDY_TOPK = ((0.95, 3), (0.8, 5), (0.5, 8), (0.0, 10))
SAMPLING_TOPK = ((0.95, 1), (0.8, 3), (0.5, 5), (0.0, 10))


def k_for_confidence(p: float, bins) -> int:
    for thr, k in bins:
        if p > thr:
            return k
    return bins[-1][1]


@dataclass
class DraftLevel:
    """Children of spine node ``depth`` (0 = root): candidate tokens in draw/rank order and their draft probs."""

    tokens: list
    probs: list
    dist: Optional[torch.Tensor] = None  # the draft distribution they were drawn from (sampling only)
    hidden: Optional[torch.Tensor] = None  # KVQ: spine node ``depth``'s residual [1, D] at the boundary layer


@dataclass
class Tree:
    parents: torch.Tensor   # [N] long, parents[0] = -1
    tokens: torch.Tensor    # [N] long
    depth: torch.Tensor     # [N] long
    mask: TreeMask          # ancestor bitmask for the verify pass
    draft_probs: Optional[torch.Tensor]  # [N, V] for sampling acceptance (rows of spine nodes), else None
    n_spine: int            # nodes 0..n_spine-1 are the spine (root included)

    @property
    def size(self) -> int:
        return self.parents.shape[0]


def build_tree(root_token: int, levels: list, prefix_len: int, max_nodes: int, device) -> Tree:
    """Lay out root + spine + siblings, keep the ``max_nodes`` best by cumulative draft log-probability.

    ``levels[j].tokens[0]`` continues the spine when there is a level j+1. A node's score never exceeds its parent's
    and, among siblings, never exceeds an earlier-drawn sibling's (enforced by a running minimum), so the kept set is
    closed under ancestors and keeps a prefix of each node's children in draw order -- which sampling acceptance
    needs when siblings were drawn without replacement.
    """
    n_spine = max(1, len(levels))  # root + levels[j].tokens[0] for every level but the last
    parents = [-1]
    tokens = [root_token]
    score = [0.0]
    for j in range(n_spine - 1):
        parents.append(j)
        tokens.append(levels[j].tokens[0])
        score.append(min(score[j] + _log(levels[j].probs[0]), score[j]))
    for j, lv in enumerate(levels):
        prev = score[j + 1] if j + 1 < n_spine else score[j]  # running minimum starts at the spine child
        start = 1 if j + 1 < n_spine else 0
        for r in range(start, len(lv.tokens)):
            s = min(score[j] + _log(lv.probs[r]), prev)
            parents.append(j)
            tokens.append(lv.tokens[r])
            score.append(s)
            prev = s
    N = len(parents)
    keep = list(range(N))
    if N > max_nodes:
        order = sorted(range(N), key=lambda i: (-score[i], i))
        keep = sorted(order[:max_nodes])
        remap = {old: new for new, old in enumerate(keep)}
        parents = [-1 if parents[i] < 0 else remap[parents[i]] for i in keep]
        tokens = [tokens[i] for i in keep]
        n_spine = sum(1 for i in keep if i < n_spine)
    par = torch.tensor(parents, dtype=torch.long, device=device)
    anc = ancestor_matrix(par)
    draft_probs = None
    if levels and levels[0].dist is not None:
        V = levels[0].dist.shape[-1]
        draft_probs = torch.zeros(len(parents), V, dtype=torch.float32, device=device)
        for j in range(min(len(levels), n_spine)):
            draft_probs[j] = levels[j].dist
    return Tree(
        parents=par,
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        depth=anc.sum(1) - 1,
        mask=TreeMask(prefix_len, pack_tree_mask(anc)),
        draft_probs=draft_probs,
        n_spine=n_spine,
    )


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -1e30
