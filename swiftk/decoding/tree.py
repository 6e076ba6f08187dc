"""The verification tree and every format it takes: node lists, the ancestor matrix, the packed bitmask the
kernels read (:class:`TreeMask`), and the tree builder.

A tree is general (a parent index per node, topological order, node 0 = the root = the pending token). Its nodes
come from the layer-skip draft (a spine -- its top-1 chain -- with candidate siblings hanging off every spine node)
and from free chains (:class:`Chain`: context n-grams, the session's earlier outputs, corpus n-grams), each joined
where it agrees with nodes already there.
Spine nodes are stored first, so when the spine is accepted its KV already sits in the right slots and the commit
copies nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..options import GREEDY_TOPK, SAMPLING_TOPK  # noqa: F401  (re-exported: the tree's top-k bins)
from ..proposers.base import Chain, DraftLevel  # noqa: F401  (re-exported: a tree's inputs)
from ..runtime.ops.masks import TreeMask, unpack_tree_mask
from ..sample.rejection import accept_greedy_host, accept_sampling

ROOT, DRAFT = "root", "draft"   # node sources; a free chain's nodes carry its source's name


# ------------------------------------------------------------------------------------------- building
@dataclass
class Tree:
    parents: torch.Tensor   # [N] long, parents[0] = -1
    tokens: torch.Tensor    # [N] long
    depth: torch.Tensor     # [N] long
    mask: TreeMask          # prefix + ancestor relation for the verify pass
    draft_probs: Optional[torch.Tensor]  # [N, V] for rejection sampling (rows of spine nodes), else None
    n_spine: int            # nodes 0..n_spine-1 are the layer-skip draft's spine (root included)
    source: list            # per node: ROOT, DRAFT or the name of the free source that added it
    value: list             # per node: estimated probability that it is accepted (the gate's currency)
    prob: list              # per node: the source's own probability for its token (draft prob, n-gram estimate)
    key: list               # per node: what its source files the outcome under (draft nodes: the draft prob)
    host_parents: list      # parents and tokens as host ints: the round's bookkeeping reads these, not the tensors
    host_tokens: list       # (each read of a small tensor costs ~10 us in a round, after a pass flushed the caches)

    @property
    def size(self) -> int:
        return len(self.host_parents)

    def outcomes(self, path: list) -> list:
        """(node, accepted?) for every node whose parent was accepted: what the sources learn from."""
        on, par = set(path), self.host_parents
        return [(i, i in on) for i in range(1, self.size) if par[i] in on]


def _ancestors(parents: list, dev: torch.device) -> tuple:
    """(ancestor bit sets as Python ints, packed int32 words or None, bool rows [N, N]) of a tree whose parents come
    first."""
    # Built on the host (on a GPU every tiny op would be a kernel launch), then moved in 3 copies. Parents come
    # first, so each node's ancestor set is its parent's plus itself: one Python int per node is the packed mask.
    anc_bits = []
    for i, p in enumerate(parents):
        anc_bits.append((anc_bits[p] if p >= 0 else 0) | (1 << i))
    W = (len(parents) + 31) // 32
    bits = None   # a small CPU tree's bits only if a kernel asks (TreeMask.packed): the CPU layer loop reads anc
    if len(parents) > 24 or dev.type != "cpu":
        bits = torch.tensor([[_int32((m >> (32 * w)) & 0xFFFFFFFF) for w in range(W)] for m in anc_bits],
                            dtype=torch.int32)
    if len(parents) <= 24:   # small trees (most rounds): rows copied on the host beat unpacking the bits in torch
        rows = []
        for i, p in enumerate(parents):
            r = list(rows[p]) if p >= 0 else [False] * len(parents)
            r[i] = True
            rows.append(r)
        anc = torch.tensor(rows, dtype=torch.bool)
    else:
        anc = unpack_tree_mask(bits, len(parents))
    return anc_bits, bits, anc


def build_tree(root_token: int, levels: list, prefix_len: int, max_nodes: int, device, *, chains=(),
               calibrate: Callable[[float], float] = lambda p: p,
               choose_size: Optional[Callable[[list], int]] = None) -> Optional[Tree]:
    """Lay out root + spine + siblings + the free ``chains`` (in order), keep the best nodes by estimated
    acceptance.

    A node's value is its parent's times ``calibrate(draft prob)`` (a chain's node: ``chain.probs[d]``; a chain
    runs through nodes already there while its tokens agree, and a node two sources agree on keeps the larger
    value). Values never exceed the parent's and, among draft siblings, never exceed an earlier-drawn sibling's
    (a running minimum), so
    the kept set is closed under ancestors and keeps a prefix of each node's children in draw order -- which
    rejection sampling needs when siblings were drawn without replacement. ``choose_size(sorted values)`` (the
    speed gate) may keep fewer than ``max_nodes``; None when it keeps no node (or there is none): a plain step.
    """
    n_spine = max(1, len(levels))  # root + levels[j].tokens[0] for every level but the last
    parents, tokens, score, source, prob, key = [-1], [root_token], [0.0], [ROOT], [1.0], [None]
    for j in range(n_spine - 1):
        parents.append(j)
        tokens.append(levels[j].tokens[0])
        prob.append(levels[j].probs[0])
        key.append(levels[j].probs[0])
        score.append(min(score[j] + _log(calibrate(levels[j].probs[0])), score[j]))
        source.append(DRAFT)
    for j, lv in enumerate(levels):
        prev = score[j + 1] if j + 1 < n_spine else score[j]  # running minimum starts at the spine child
        for r in range(1 if j + 1 < n_spine else 0, len(lv.tokens)):
            s = min(score[j] + _log(calibrate(lv.probs[r])), prev)
            parents.append(j)
            tokens.append(lv.tokens[r])
            score.append(s)
            source.append(DRAFT)
            prob.append(lv.probs[r])
            key.append(lv.probs[r])
            prev = s
    for ch in chains:
        if ch.tokens:
            _add_chain(parents, tokens, score, source, prob, key, ch)
    N = len(parents)
    order = sorted(range(N), key=lambda i: (-score[i], i))
    keep_n = min(N, max_nodes)
    if choose_size is not None:
        keep_n = max(1, min(keep_n, choose_size([math.exp(score[i]) for i in order[1:keep_n]]) + 1))
    if keep_n == 1:   # nothing worth verifying: the loop takes a plain step (a root-only Tree cost ~15 us there)
        return None
    if keep_n < N:
        keep = sorted(order[:keep_n])
        remap = {old: new for new, old in enumerate(keep)}
        parents = [-1 if parents[i] < 0 else remap[parents[i]] for i in keep]
        tokens, score = [tokens[i] for i in keep], [score[i] for i in keep]
        source, prob, key = [source[i] for i in keep], [prob[i] for i in keep], [key[i] for i in keep]
        n_spine = sum(1 for i in keep if i < n_spine)
    dev = torch.device(device)
    anc_bits, bits, anc = _ancestors(parents, dev)
    ptd = torch.tensor([parents, tokens, [m.bit_count() - 1 for m in anc_bits]], dtype=torch.long)  # + depth
    if dev.type != "cpu":
        ptd, anc, bits = ptd.to(dev), anc.to(dev), bits.to(dev)
    draft_probs = None
    if levels and levels[0].dist is not None:
        V = levels[0].dist.shape[-1]
        draft_probs = torch.zeros(len(parents), V, dtype=torch.float32, device=ptd.device)
        for j in range(min(len(levels), n_spine)):
            draft_probs[j] = levels[j].dist
    return Tree(parents=ptd[0], tokens=ptd[1], depth=ptd[2], mask=TreeMask(prefix_len, bits, anc),
                draft_probs=draft_probs, n_spine=n_spine, source=source, value=[math.exp(s) for s in score], prob=prob,
                key=key, host_parents=parents, host_tokens=tokens)



def _add_chain(parents, tokens, score, source, prob, key, chain: Chain) -> None:
    """Hang ``chain`` under the root, walking existing nodes while their tokens agree (no duplicate children).

    Where it runs through a free node whose value is lower than its own estimate, that node (and, to keep values
    monotone along every path, nothing else: its descendants keep theirs) takes the larger value -- two sources
    agreeing make a token likelier than either alone. Draft nodes keep their value: raising one could reorder
    draft siblings, whose draw order rejection sampling needs."""
    children: dict = {}
    for i in range(1, len(parents)):
        children.setdefault((parents[i], tokens[i]), i)
    node = 0
    for d, tok in enumerate(chain.tokens):
        s = min(score[node] + _log(chain.probs[d]), score[node])
        hit = children.get((node, tok))
        if hit is None:
            parents.append(node)
            tokens.append(tok)
            score.append(s)
            source.append(chain.source)
            prob.append(chain.probs[d])
            key.append(chain.keys[d] if d < len(chain.keys) else None)
            hit = len(parents) - 1
            children[(node, tok)] = hit
        elif source[hit] != DRAFT and s > score[hit]:
            score[hit] = s
        node = hit


def _int32(u: int) -> int:
    """The low 32 bits of ``u`` read as a signed int32 (the packed mask's word format)."""
    return u - (1 << 32) if u >= 1 << 31 else u


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -1e30


def node_values(chains) -> list:
    """The values of the free chains' nodes as build_tree would lay them out (a node by its path from the root;
    where sources agree the larger value, each child priced from its merged parent), best first."""
    ids, vals = {}, []
    for ch in chains:
        node = -1
        for t, p in zip(ch.tokens, ch.probs):
            v = (vals[node] if node >= 0 else 1.0) * min(p, 1.0)
            i = ids.get((node, t))
            if i is None:
                i = ids[node, t] = len(vals)
                vals.append(v)
            else:
                vals[i] = max(vals[i], v)
            node = i
    return sorted(vals, reverse=True)


# ------------------------------------------------------------------------------------------- acceptance
def accept_tree(tree: Tree, target: torch.Tensor, draft_probs_rule: Optional[str] = None,
                generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, int]:
    """The rejection sampler (sample/rejection.py) on a built tree: accepted node indices and the bonus token.

    ``target``: [N, V] scores whose argmax is the target's choice (greedy: logits; coupled sampling: perturbed
    log-probs, see ``sample.sampler.Sampler``), or with ``draft_probs_rule="rejection"`` the target's processed probs
    for multi-candidate rejection sampling against ``tree.draft_probs``."""
    if draft_probs_rule == "rejection":
        return accept_sampling(tree.parents, tree.tokens, target, tree.draft_probs, replacement=False,
                               generator=generator)
    nodes, bonus = accept_nodes(tree, target)
    return torch.tensor(nodes, dtype=torch.long, device=tree.parents.device), bonus


def accept_nodes(tree: Tree, target: torch.Tensor) -> tuple[list, int]:
    """accept_tree's greedy rule as host values (accepted node indices root..last, bonus): the decode loop's form."""
    return accept_greedy_host(tree.host_parents, tree.host_tokens, target)
