"""The rejection sampler: which nodes of a verified token tree to keep and which token the target adds. Stateless:
it reads the tree as tensors or lists (parents, tokens) and the target's rows.

Tree: N nodes in topological order, ``parents[0] == -1`` and ``parents[i] < i``; node 0 is the root, the pending
token. ``tokens[i]`` is node i's token. Children of a node are tried in increasing index order. Row i of the target
(logits or probs) is the target's next-token distribution after the path root..i.

Invariant (what makes decoding lossless): the tokens emitted by a round -- the accepted path after the root, then
the bonus -- are distributed exactly as if the target had generated them one at a time.
  * greedy: they are the target's argmax continuation (``accept_greedy``).
  * sampling (``accept_sampling``): recursive rejection sampling over the tree (SpecInfer-style multi-candidate
    speculative sampling). At a node with current target distribution r, child c (token x, drawn from q_c) is
    accepted with probability min(1, r(x) / q_c(x)); on acceptance the walk moves to c and r becomes c's target
    row; on rejection r <- normalise(max(r - q_c, 0)) and the next sibling is tried. When no child is accepted
    (or the node is a leaf) the bonus token is drawn from r.

Which q_c is right depends on how the drafter drew the children of a node whose draft distribution is q:
  * ``draft_probs`` given, ``replacement=True``: children are i.i.d. draws from q, *all* kept in draw order,
    duplicates included; q_c = q. A repeated token is never accepted (its residual is already 0) but it still
    counts as a draw and updates the residual. Merging duplicates, or skipping their residual update, under
    this rule is biased (exact enumeration: up to 0.2 total variation on 3-token vocabularies).
  * ``draft_probs`` given, ``replacement=False``: children are sequential draws without replacement (e.g.
    ``logits.sample_without_replacement``); q_c = q with the earlier siblings' tokens zeroed, renormalised.
    This rule is also lossless for i.i.d. draws with duplicates merged (first occurrence kept, in order): the
    distinct tokens of i.i.d. draws are distributed as draws without replacement, stopped at a count that does
    not depend on the verifier's randomness. Repeats left in the tree are skipped (their q_c is 0), which is
    the same as merging them.
  * ``draft_probs=None``: the children are chosen deterministically (e.g. the draft's top-k, as SWIFT's tree
    builder does); q_c is a point mass on x, so x is accepted with probability r(x) and a rejection zeroes r(x).
    This is lossless for any candidate set that does not look at the verifier's random numbers. Passing
    the draft's q for deterministically chosen children is NOT lossless.
Edge cases: a child whose q_c(x) == 0 could not have been drawn; it is skipped (neither accepted nor a residual
update). If max(r - q_c, 0) sums to zero (only when r == q_c up to rounding), r is kept.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import SwiftkError
from ..runtime.ops.cpu_accept import greedy_path
from ..runtime.ops.cpu_topk import topk_rows


def check_parents(parents: torch.Tensor) -> int:
    if parents.dim() != 1 or parents.numel() == 0 or parents.dtype not in (torch.int32, torch.int64):
        raise SwiftkError(f"parents must be a non-empty 1-D integer tensor, got {parents.dtype} {tuple(parents.shape)}")
    return parents.numel()


def validate_tree(parents: torch.Tensor, tokens: torch.Tensor) -> None:
    """Full structural check (syncs with the host; for tests and debugging, not the decode loop)."""
    n = check_parents(parents)
    if tokens.shape[-1] != n:
        raise SwiftkError(f"tokens has {tokens.shape[-1]} nodes, parents has {n}")
    p = parents.cpu().long()
    if p[0] != -1:
        raise SwiftkError(f"parents[0] must be -1 (root), got {int(p[0])}")
    idx = torch.arange(n)
    bad = (p[1:] < 0) | (p[1:] >= idx[1:])
    if bad.any():
        i = int(idx[1:][bad][0])
        raise SwiftkError(f"parents[{i}] = {int(p[i])} must be in [0, {i}) (topological order)")


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """BoolTensor [N, N]: row i marks the ancestors of node i and i itself. No host sync.

    Reachability by repeated squaring of the parent relation: after s squarings rows hold ancestors up to
    2**s levels up, so ceil(log2 N) matrix products suffice."""
    n = check_parents(parents)
    idx = torch.arange(n, device=parents.device)
    par = parents.long().clamp_min(0)  # the root points at itself
    reach = torch.zeros(n, n, dtype=torch.float32, device=parents.device)
    reach[idx, idx] = 1.0
    reach[idx, par] = 1.0
    for _ in range(max(1, (n - 1).bit_length())):
        reach = (reach @ reach).clamp_max_(1.0)
    return reach > 0


def depths(parents: torch.Tensor) -> torch.Tensor:
    """LongTensor [N]: depth of each node, root = 0."""
    return ancestor_matrix(parents).sum(dim=1) - 1


def _path_and_bonus(on_path: torch.Tensor, bonus: torch.Tensor) -> tuple[torch.Tensor, int]:
    # The one host sync: path membership and bonus come back together.
    packed = torch.cat([on_path.long(), bonus.reshape(1).long()]).cpu()
    path = torch.nonzero(packed[:-1]).flatten()  # ancestors have smaller indices: root..last order
    return path.to(on_path.device), int(packed[-1])


def accept_greedy(parents: torch.Tensor, tokens: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Longest root-to-node path whose every non-root token is the target argmax at its parent.

    ``target``: logits/probs [N, V] or argmax ids [N]. Returns (path: LongTensor of node indices root..last
    accepted, on ``parents``' device; bonus: the target argmax at the last path node). Among equally deep accepted
    nodes (only possible with duplicate sibling tokens) the lowest index wins. One host sync (the N argmax ids).
    """
    n = check_parents(parents)
    if tokens.shape != (n,):
        raise SwiftkError(f"tokens must have shape ({n},), got {tuple(tokens.shape)}")
    if target.dim() == 2 and target.shape[0] == n:
        top = topk_rows(target, 1)[:, 0]   # torch.argmax's choice (first maximal index)
    elif target.shape == (n,) and not target.is_floating_point():
        top = target
    else:
        raise SwiftkError(f"target must be [N={n}, V] logits/probs or [N] argmax ids, got {tuple(target.shape)}")
    path, bonus = _greedy_walk(parents.tolist(), tokens.tolist(), top.tolist())
    return torch.tensor(path, dtype=torch.long, device=parents.device), bonus


def _greedy_walk(par: list, tok: list, top: list) -> tuple[list, int]:
    """The greedy rule on host lists (kernels/cpu/cpu_topk.cpp's ``swk_greedy_path`` is its native twin), answered
    as (accepted nodes root..last, bonus): a node is accepted when its parent was and its token is the parent's
    argmax; the deepest accepted node wins, the lowest index among equally deep ones. Over N <= 64 host ints it
    beats tensor ops (~0.5 ms), and on a GPU it costs the one sync that fetching the argmax ids costs anyway."""
    ok, depth, best = [True] + [False] * (len(par) - 1), [0] * len(par), 0
    for i in range(1, len(par)):
        p = par[i]
        if ok[p] and tok[i] == top[p]:
            ok[i], depth[i] = True, depth[p] + 1
            if depth[i] > depth[best]:
                best = i
    path = [best]
    while path[-1] > 0:
        path.append(par[path[-1]])
    return path[::-1], int(top[best])


def accept_sampling_batched(
    parents: torch.Tensor,
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    replacement: bool,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """B independent trees sharing one shape: tokens [B, N], target_probs / draft_probs [B, N, V].

    Returns (accepted [B, N] bool, marking each tree's path root..last, bonus [B] long). No host sync: one pass
    over the nodes in index order, with per-tree state (current node, residual r, remaining draft mass) kept on
    device. This works because node i's siblings and children all come after its parent.
    """
    n = check_parents(parents)
    if tokens.dim() != 2 or tokens.shape[1] != n:
        raise SwiftkError(f"tokens must be [B, N={n}], got {tuple(tokens.shape)}")
    b = tokens.shape[0]
    if target_probs.dim() != 3 or target_probs.shape[:2] != (b, n):
        raise SwiftkError(f"target_probs must be [B={b}, N={n}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise SwiftkError(f"draft_probs shape {tuple(draft_probs.shape)} != target_probs {tuple(target_probs.shape)}")
    dev = tokens.device
    target_probs = target_probs.float()
    par = parents.long().to(dev)
    tok = tokens.long()
    rows = torch.arange(b, device=dev)
    # A sibling repeating an earlier sibling's token is never accepted (see module docstring).
    same_parent = par[:, None] == par[None, :]
    earlier = torch.ones(n, n, dtype=torch.bool, device=dev).tril(-1)
    dup = ((tok[:, :, None] == tok[:, None, :]) & (same_parent & earlier)[None]).any(dim=2)

    u = torch.rand(b, n, generator=generator, device=dev)
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    accepted = torch.zeros(b, n, dtype=torch.bool, device=dev)
    accepted[:, 0] = True
    r = target_probs[:, 0].clone()
    q_left = None if draft_probs is None else draft_probs[:, 0].float().clone()
    for i in range(1, n):
        x = tok[:, i]
        active = cur == par[i]
        if q_left is None:  # deterministic candidate: point mass on x
            q_c = torch.zeros_like(r).scatter_(1, x[:, None], 1.0)  # one_hot would sync to check x
        elif replacement:
            q_c = q_left
        else:
            mass = q_left.sum(dim=1, keepdim=True)
            q_c = torch.where(mass > 0, q_left / mass.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        qx = q_c[rows, x]
        rx = r[rows, x]
        tried = active & (qx > 0)
        # u < r(x)/q(x) without dividing: certain acceptance when r(x) >= q(x).
        take = tried & ~dup[:, i] & (u[:, i] * qx < rx)
        reject = tried & ~take
        resid = (r - q_c).clamp_min(0.0)
        total = resid.sum(dim=1, keepdim=True)
        upd = (reject[:, None] & (total > 0))
        r = torch.where(upd, resid / total.clamp_min(torch.finfo(torch.float32).tiny), r)
        if q_left is not None and not replacement:
            q_left = torch.where(tried[:, None], q_left.scatter(1, x[:, None], 0.0), q_left)
        r = torch.where(take[:, None], target_probs[:, i], r)
        if q_left is not None:
            q_left = torch.where(take[:, None], draft_probs[:, i].float(), q_left)
        cur = torch.where(take, i, cur)
        accepted[:, i] = take
    bonus = torch.multinomial(r, 1, generator=generator).squeeze(1)
    return accepted, bonus


def accept_sampling(
    parents: torch.Tensor,
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    replacement: bool,
    generator: torch.Generator,
) -> tuple[torch.Tensor, int]:
    """Lossless tree speculative sampling for one tree: tokens [N], target_probs / draft_probs [N, V].

    ``draft_probs`` row i is the processed draft distribution node i's children were drawn from, or None for
    deterministically chosen children (see the module docstring for which rule fits which drafter).
    Returns (path: LongTensor of node indices root..last accepted, bonus token). One host sync.
    """
    n = check_parents(parents)
    if tokens.shape != (n,):
        raise SwiftkError(f"tokens must have shape ({n},), got {tuple(tokens.shape)}")
    if target_probs.dim() != 2:
        raise SwiftkError(f"target_probs must be [N, V], got {tuple(target_probs.shape)}")
    accepted, bonus = accept_sampling_batched(
        parents,
        tokens[None],
        target_probs[None],
        None if draft_probs is None else draft_probs[None],
        replacement,
        generator,
    )
    return _path_and_bonus(accepted[0], bonus[0])


def accept_greedy_host(parents: list, tokens: list, target: torch.Tensor) -> tuple[list, int]:
    """accept_greedy on CPU scores [N, V] as host values (accepted node indices root..last, bonus): the decode loop's
    form, which makes no tensor. One C call where the CPU library is loaded (it reduces only the rows of accepted
    nodes), else argmax rows (on the scores' device) and the host walk."""
    if target.dim() != 2 or target.shape[0] != len(parents):
        raise SwiftkError(f"target must be [N={len(parents)}, V] scores, got {tuple(target.shape)}")
    got = greedy_path(target.contiguous(), parents, tokens)
    if got is not None:
        return got
    return _greedy_walk(parents, tokens, topk_rows(target, 1)[:, 0].tolist())
