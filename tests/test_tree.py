"""Tree layout: spine first, topological order, budget cut keeps ancestors and a draw-order prefix of siblings."""
import random

import torch

from swiftk.sample.rejection import ancestor_matrix
from swiftk.runtime.ops.reference import unpack_tree_mask
from swiftk.decoding.tree import GREEDY_TOPK, build_tree
from swiftk.proposers.base import DraftLevel, k_for_confidence
from swiftk.runtime.ops.masks import pack_tree_mask


def _levels(rng, depth):
    out = []
    for _ in range(depth):
        k = rng.randint(1, 6)
        probs = sorted((rng.random() for _ in range(k)), reverse=True)
        out.append(DraftLevel(tokens=rng.sample(range(1000), k), probs=probs))
    return out


def test_layout_without_cut():
    lv = [DraftLevel([10, 11, 12], [0.9, 0.05, 0.01]), DraftLevel([20, 21], [0.6, 0.3])]
    t = build_tree(7, lv, prefix_len=5, max_nodes=64, device="cpu")
    assert t.tokens.tolist() == [7, 10, 11, 12, 20, 21]
    assert t.parents.tolist() == [-1, 0, 0, 0, 1, 1]
    assert t.depth.tolist() == [0, 1, 1, 1, 2, 2]
    assert t.n_spine == 2 and t.mask.prefix_len == 5
    assert torch.equal(unpack_tree_mask(t.mask.packed(), 6), ancestor_matrix(t.parents))


def test_random_cuts_are_closed_and_prefix_ordered():
    rng = random.Random(0)
    for _ in range(200):
        lv = _levels(rng, rng.randint(1, 8))
        full = build_tree(1, lv, 0, 10_000, "cpu")
        budget = rng.randint(1, full.size)
        t = build_tree(1, lv, 0, budget, "cpu")
        if budget == 1:   # the root alone: nothing to verify
            assert t is None
            continue
        assert t.size == budget
        # the masks built from Python bit sets equal the matrix reference and its packing
        anc = ancestor_matrix(t.parents)
        assert torch.equal(t.mask.ancestors, anc) and torch.equal(t.mask.packed(), pack_tree_mask(anc))
        assert torch.equal(t.depth, anc.sum(1) - 1)
        par = t.parents.tolist()
        assert par[0] == -1 and all(0 <= p < i for i, p in enumerate(par) if i)
        # spine nodes are a prefix and form a chain
        assert all(par[i] == i - 1 for i in range(1, t.n_spine))
        # siblings kept are a prefix of each parent's children in the full tree (draw order)
        fpar, ftok = full.parents.tolist(), full.tokens.tolist()
        for p in range(t.n_spine):
            kept = [t.tokens[i].item() for i in range(t.size) if par[i] == p]
            allc = [ftok[i] for i in range(full.size) if fpar[i] == p]
            assert kept == allc[: len(kept)]


def test_k_for_confidence_bins():
    assert [k_for_confidence(p, GREEDY_TOPK) for p in (0.99, 0.9, 0.6, 0.1)] == [3, 5, 8, 10]


def test_mask_rows_are_the_ancestor_relation_at_every_size():
    """build_tree fills the ancestor rows on the host for small trees and unpacks its bits for large ones: both
    must be the parents' ancestor relation, and agree with the packed bits the kernels read."""
    from swiftk.decoding.tree import Chain

    rng = random.Random(5)
    for n in (1, 2, 5, 23, 24, 25, 40, 63):
        chains = []
        while sum(len(c.tokens) for c in chains) < n - 1:
            k = rng.randint(1, 6)
            chains.append(Chain([rng.randint(0, 9) for _ in range(k)], [0.9] * k, "x"))
        tree = build_tree(3, [], 10, 64, "cpu", chains=chains)
        if n == 1:   # the root alone: nothing to verify
            assert tree is None
            continue
        anc = tree.mask.ancestors
        assert torch.equal(anc, ancestor_matrix(tree.parents)), n
        assert (tree.mask.bits is None) == (tree.size <= 24), n   # small CPU trees: bits only when asked
        assert torch.equal(anc, unpack_tree_mask(tree.mask.packed(), tree.size)), n
