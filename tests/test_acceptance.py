"""Tree acceptance rules (swiftk.sample.rejection): exact hand cases and statistical losslessness."""
import math

import pytest
import torch

from swiftk.sample.rejection import (
    accept_greedy,
    accept_sampling,
    accept_sampling_batched,
    ancestor_matrix,
    depths,
    validate_tree,
)
from swiftk.errors import SwiftkError
from swiftk.sample.logits import sample_without_replacement


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; a count in a zero-probability cell gives p = 0."""
    counts = counts.double().flatten()
    probs = expected_probs.double().flatten()
    n = counts.sum()
    if (counts[probs == 0] > 0).any():
        return 0.0
    keep = probs > 0
    exp = probs[keep] * n
    stat = ((counts[keep] - exp) ** 2 / exp).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def fits(counts: torch.Tensor, exact: torch.Tensor) -> tuple[bool, float, float]:
    """(passes, TV, p-value): TV below 3*sqrt(cells/n) and chi-square p-value above 1e-3."""
    n = float(counts.sum())
    tv = 0.5 * float((counts.double().flatten() / n - exact.double().flatten()).abs().sum())
    p = chi2_pvalue(counts, exact)
    return tv < 3 * math.sqrt(exact.numel() / n) and p > 1e-3, tv, p


def one_hot_rows(ids, v):
    return torch.nn.functional.one_hot(torch.tensor(ids), v).float()


T = torch.tensor

# ---- tree helpers ---------------------------------------------------------------------------------------------


def naive_ancestors(parents):
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return anc


def random_parents(n, g):
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 33, 64, 70])
def test_ancestor_matrix_and_depths_match_naive_walk(n):
    g = gen(n)
    for _ in range(5):
        parents = random_parents(n, g)
        anc = ancestor_matrix(T(parents))
        want = naive_ancestors(parents)
        assert torch.equal(anc, want)
        assert depths(T(parents)).tolist() == [int(r.sum()) - 1 for r in want]


def test_ancestor_matrix_of_a_long_chain():
    parents = [-1] + list(range(63))
    assert torch.equal(ancestor_matrix(T(parents)), torch.ones(64, 64, dtype=torch.bool).tril())


@pytest.mark.parametrize(
    "parents, word",
    [
        ([0, 0], r"parents\[0\]"),
        ([-1, 1], r"parents\[1\]"),
        ([-1, 0, -1], r"parents\[2\]"),
        ([-1, 0, 3], r"parents\[2\]"),
    ],
)
def test_validate_tree_rejects_bad_parents(parents, word):
    with pytest.raises(SwiftkError, match=word):
        validate_tree(T(parents), torch.zeros(len(parents), dtype=torch.long))


def test_validate_tree_accepts_good_tree_and_checks_lengths():
    validate_tree(T([-1, 0, 0, 1]), T([5, 1, 2, 3]))
    with pytest.raises(SwiftkError, match="nodes"):
        validate_tree(T([-1, 0]), T([5, 1, 2]))


# ---- greedy ---------------------------------------------------------------------------------------------------


def argmax_ids(rows):
    return T(rows)


def test_greedy_chain_all_accepted():
    # Nodes 1..3 carry 4, 5, 6; the target's argmax after each node continues the chain, then says 9.
    parents, tokens = T([-1, 0, 1, 2]), T([3, 4, 5, 6])
    path, bonus = accept_greedy(parents, tokens, argmax_ids([4, 5, 6, 9]))
    assert path.tolist() == [0, 1, 2, 3] and bonus == 9


def test_greedy_chain_rejects_at_depth_two():
    parents, tokens = T([-1, 0, 1, 2]), T([3, 4, 5, 6])
    path, bonus = accept_greedy(parents, tokens, argmax_ids([4, 7, 6, 9]))
    assert path.tolist() == [0, 1] and bonus == 7


def test_greedy_second_sibling_matches_and_logits_input_agrees():
    parents, tokens = T([-1, 0, 0, 1, 2]), T([0, 5, 6, 7, 8])
    top = [6, 7, 8, 1, 9]
    path, bonus = accept_greedy(parents, tokens, argmax_ids(top))
    assert path.tolist() == [0, 2, 4] and bonus == 9
    logits = torch.randn(5, 10, generator=gen()) + 10 * one_hot_rows(top, 10)
    assert accept_greedy(parents, tokens, logits)[0].tolist() == [0, 2, 4]
    assert accept_greedy(parents, tokens, logits)[1] == 9


def test_greedy_duplicate_siblings_prefers_deeper_then_lowest_index():
    # Nodes 1 and 2 both carry 5 (accepted); only node 2's child matches, so the deeper path wins.
    parents, tokens = T([-1, 0, 0, 1, 2]), T([0, 5, 5, 7, 8])
    path, bonus = accept_greedy(parents, tokens, argmax_ids([5, 3, 8, 0, 4]))
    assert path.tolist() == [0, 2, 4] and bonus == 4
    # Equal depth: lowest index.
    path, bonus = accept_greedy(T([-1, 0, 0]), T([0, 5, 5]), argmax_ids([5, 6, 7]))
    assert path.tolist() == [0, 1] and bonus == 6


def test_greedy_single_root_node():
    path, bonus = accept_greedy(T([-1]), T([3]), torch.tensor([[0.1, 0.2, 0.9, 0.0]]))
    assert path.tolist() == [0] and bonus == 2


def test_greedy_nothing_accepted():
    path, bonus = accept_greedy(T([-1, 0, 0]), T([1, 2, 3]), argmax_ids([4, 0, 0]))
    assert path.tolist() == [0] and bonus == 4


def naive_greedy(parents, tokens, top):
    best = (0, 0)  # (depth, -index)
    for i in range(len(parents)):
        j, depth, ok = i, 0, True
        while j > 0:
            ok &= tokens[j] == top[parents[j]]
            j, depth = parents[j], depth + 1
        if ok and (depth, -i) > best:
            best = (depth, -i)
    node = -best[1]
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1], top[path[0]]


def test_greedy_matches_naive_on_random_trees_with_many_duplicates():
    g = gen(11)
    for trial in range(200):
        n = int(torch.randint(1, 40, (1,), generator=g))
        parents = random_parents(n, g)
        tokens = torch.randint(0, 3, (n,), generator=g).tolist()
        top = torch.randint(0, 3, (n,), generator=g).tolist()
        path, bonus = accept_greedy(T(parents), T(tokens), T(top))   # the host walk, on every device
        assert (path.tolist(), bonus) == naive_greedy(parents, tokens, top), trial


@pytest.mark.parametrize("V", [3, 50, 49152])
def test_greedy_path_kernel_matches_naive_on_random_trees(V):
    """The loop's CPU acceptance (one call, kernels/cpu/cpu_topk.cpp: it reduces only accepted nodes' rows) against
    the naive walk over torch.argmax: duplicate siblings, tied scores (lowest index wins), NaN rows (NaN first)."""
    from swiftk.runtime.ops import cpu_accept, cpu_linear

    if not cpu_linear.available():
        pytest.skip("CPU kernels unavailable on this host")
    g = gen(12 + V)
    for trial in range(60 if V > 50 else 200):
        n = int(torch.randint(1, 30, (1,), generator=g))
        parents = random_parents(n, g)
        x = torch.randint(0, 3, (n, V), generator=g).float()   # few values: ties in every row
        if trial % 7 == 0:
            x[int(torch.randint(0, n, (1,), generator=g)), int(torch.randint(0, V, (1,), generator=g))] = float("nan")
        top = x.argmax(dim=-1).tolist()
        # tokens: each node's parent's argmax half the time, so paths run deep
        tokens = [top[p] if p >= 0 and bool(torch.rand(1, generator=g) < 0.5) else
                  int(torch.randint(0, min(V, 3), (1,), generator=g)) for p in parents]
        assert cpu_accept.greedy_path(x, parents, tokens) == naive_greedy(parents, tokens, top), trial
    with pytest.raises(SwiftkError, match="greedy_path"):
        cpu_accept.greedy_path(torch.zeros(3, V), [-1, 2, 0], [0, 0, 0])   # a parent after its child


def test_accept_nodes_rejects_scores_of_another_tree():
    from swiftk.decoding.tree import Chain, accept_nodes, build_tree

    tree = build_tree(1, [], 4, 8, "cpu", chains=[Chain([2, 3], [0.9, 0.9], "x")])
    assert accept_nodes(tree, torch.zeros(3, 5)) == ([0], 0)
    with pytest.raises(SwiftkError, match="N=3"):
        accept_nodes(tree, torch.zeros(2, 5))


def test_greedy_rejects_bad_shapes():
    with pytest.raises(SwiftkError, match="tokens"):
        accept_greedy(T([-1, 0]), T([1, 2, 3]), T([1, 2]))
    with pytest.raises(SwiftkError, match="target"):
        accept_greedy(T([-1, 0]), T([1, 2]), torch.zeros(3, 5))
    with pytest.raises(SwiftkError, match="parents"):
        accept_greedy(torch.zeros(0, dtype=torch.long), T([]), T([]))


# ---- sampling: exact hand cases ---------------------------------------------------------------------------------


@pytest.mark.parametrize("replacement", [True, False])
def test_sampling_draft_equal_to_target_accepts_whole_chain(replacement):
    probs = torch.softmax(torch.randn(4, 6, generator=gen(1)), -1)
    for seed in range(20):
        path, _ = accept_sampling(T([-1, 0, 1, 2]), T([0, 1, 2, 3]), probs, probs, replacement, gen(seed))
        assert path.tolist() == [0, 1, 2, 3]


def test_sampling_deterministic_candidates_with_one_hot_target():
    parents, tokens = T([-1, 0, 0, 0]), T([0, 1, 2, 3])
    target = one_hot_rows([2, 0, 4, 0], 5)
    for seed in range(10):
        path, bonus = accept_sampling(parents, tokens, target, None, False, gen(seed))
        assert path.tolist() == [0, 2] and bonus == 4
    target = one_hot_rows([0, 0, 4, 0], 5)
    path, bonus = accept_sampling(parents, tokens, target, None, False, gen(0))
    assert path.tolist() == [0] and bonus == 0


def test_sampling_single_root_node_draws_bonus_from_target():
    path, bonus = accept_sampling(T([-1]), T([7]), one_hot_rows([3], 8), one_hot_rows([5], 8), True, gen())
    assert path.tolist() == [0] and bonus == 3


def test_sampling_rejected_tokens_never_come_back_as_bonus():
    # The only child carries token 0, which the target rules out: always rejected, and the bonus comes from
    # the residual max(p - q, 0) = (0, 0.1, 0.5) -> (0, 1/6, 5/6).
    p = T([0.0, 0.5, 0.5])
    q = T([0.6, 0.4, 0.0])
    b = 20000
    tokens = T([[2, 0]]).expand(b, 2)
    acc, bonus = accept_sampling_batched(T([-1, 0]), tokens, torch.stack([p, p]).expand(b, 2, 3),
                                         torch.stack([q, q]).expand(b, 2, 3), True, gen(3))
    assert not acc[:, 1].any()
    counts = torch.bincount(bonus, minlength=3)
    assert fits(counts, T([0.0, 1 / 6, 5 / 6]))[0]


def test_sampling_skips_children_the_draft_could_not_have_drawn():
    # q(token 1) = 0: the child is neither accepted (ratio would be infinite) nor used for a residual update
    # (that would make the bonus always 1); the bonus is drawn from p itself.
    b = 20000
    p, q = T([0.5, 0.5]), T([1.0, 0.0])
    acc, bonus = accept_sampling_batched(T([-1, 0]), T([[0, 1]]).expand(b, 2), torch.stack([p, p]).expand(b, 2, 2),
                                         torch.stack([q, q]).expand(b, 2, 2), True, gen(4))
    assert not acc[:, 1].any()
    assert fits(torch.bincount(bonus, minlength=2), p)[0]


def test_sampling_without_replacement_exhausted_draft_mass_is_skipped():
    # The first child (token 0) used all of q's mass; the second child (token 1) has conditional q = 0.
    p, q = T([0.0, 1.0, 0.0]), T([1.0, 0.0, 0.0])
    for seed in range(10):
        path, bonus = accept_sampling(T([-1, 0, 0]), T([2, 0, 1]), torch.stack([p, p, p]),
                                      torch.stack([q, q, q]), False, gen(seed))
        assert path.tolist() == [0] and bonus == 1


def test_sampling_is_reproducible_and_returns_int_bonus():
    probs = torch.softmax(torch.randn(7, 9, generator=gen(5)), -1)
    draft = torch.softmax(torch.randn(7, 9, generator=gen(6)), -1)
    args = (T([-1, 0, 0, 1, 1, 2, 2]), T([0, 1, 2, 3, 4, 5, 6]), probs, draft, True)
    runs = [accept_sampling(*args, gen(8)) for _ in range(3)]
    assert all(torch.equal(runs[0][0], r[0]) and runs[0][1] == r[1] for r in runs)
    assert isinstance(runs[0][1], int) and runs[0][0].dtype == torch.long


def test_sampling_rejects_bad_shapes():
    probs = torch.full((3, 4), 0.25)
    with pytest.raises(SwiftkError, match="tokens"):
        accept_sampling(T([-1, 0, 0]), T([1, 2]), probs, probs, True, gen())
    with pytest.raises(SwiftkError, match="draft_probs"):
        accept_sampling(T([-1, 0, 0]), T([1, 2, 3]), probs, probs[:2], True, gen())
    with pytest.raises(SwiftkError, match="target_probs"):
        accept_sampling(T([-1, 0, 0]), T([1, 2, 3]), probs[:2], None, True, gen())


# ---- sampling: statistical losslessness on whole trees ----------------------------------------------------------
#
# A small Markov "language": target p0 at the root, then P[last token]; draft q0, then Q[last token]. Children of
# each node are drawn from the node's draft row (with / without replacement; "iid_as_distinct": i.i.d. draws judged
# by the without-replacement rule) or taken as its top-k (deterministic).
# Over many independent rounds the first emitted token must follow p0 and the first two tokens p0[a] * P[a, b].

V = 6
N_TRIALS = 40_000
TREES = {
    "depth1_k3": [-1, 0, 0, 0],
    "two_level": [-1, 0, 0, 1, 1, 2, 2],
    "chain": [-1, 0, 1, 2],
}


def random_rows(g, *shape):
    x = torch.rand(*shape, V, generator=g) ** 3 + 0.02  # uneven, but every token possible
    return x / x.sum(-1, keepdim=True)


def draw_tree(parents, p0, pm, q0, qm, mode, g):
    """Per-trial tokens [B, N], target rows [B, N, V], draft rows [B, N, V] (None for deterministic)."""
    n, b = len(parents), N_TRIALS
    tokens = torch.zeros(b, n, dtype=torch.long)
    for node in range(n):
        kids = [c for c in range(n) if parents[c] == node]
        if not kids:
            continue
        q = q0.expand(b, V) if node == 0 else qm[tokens[:, node]]
        if mode in ("replacement", "iid_as_distinct"):
            drawn = torch.multinomial(q, len(kids), replacement=True, generator=g)
        elif mode == "no_replacement":
            drawn = sample_without_replacement(q, len(kids), g)
        else:
            drawn = torch.topk(q, len(kids), dim=-1).indices
        tokens[:, kids] = drawn
    target = torch.cat([p0.expand(b, 1, V), pm[tokens[:, 1:]]], dim=1)
    draft = None if mode == "deterministic" else torch.cat([q0.expand(b, 1, V), qm[tokens[:, 1:]]], dim=1)
    return tokens, target, draft


def emitted_pairs(parents, tokens, accepted, bonus, pm, g):
    """First two emitted tokens per trial; when a round emits only one, the second is what the target alone
    would draw next (P[first]), so the pair's law is p0[a] * P[a, b] iff the round is lossless."""
    d = depths(T(parents))
    seq = []
    for level in (1, 2):
        at = accepted & (d == level)
        seq.append((at.any(1), (tokens * at).sum(1)))
    (has1, tok1), (has2, tok2) = seq
    first = torch.where(has1, tok1, bonus)
    nxt = torch.multinomial(pm[first], 1, generator=g).squeeze(1)
    second = torch.where(has2, tok2, torch.where(has1, bonus, nxt))
    return first, second


@pytest.mark.parametrize("mode", ["replacement", "no_replacement", "iid_as_distinct", "deterministic"])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_sampling_is_lossless_on_trees(tree, mode):
    parents = TREES[tree]
    g = gen(100 * sorted(TREES).index(tree) + len(mode))
    p0, pm = random_rows(g), random_rows(g, V)
    # A draft loosely like the target, so that rounds both accept and reject.
    q0, qm = 0.5 * p0 + 0.5 * random_rows(g), 0.5 * pm + 0.5 * random_rows(g, V)
    tokens, target, draft = draw_tree(parents, p0, pm, q0, qm, mode, g)
    accepted, bonus = accept_sampling_batched(T(parents), tokens, target, draft, mode == "replacement", g)
    # The accepted nodes form one root path.
    anc = ancestor_matrix(T(parents))
    deepest = (accepted * (depths(T(parents)) + 1)).argmax(1)
    assert torch.equal(accepted, anc[deepest])
    first, second = emitted_pairs(parents, tokens, accepted, bonus, pm, g)
    ok, tv, p = fits(torch.bincount(first, minlength=V), p0)
    assert ok, (tv, p)
    ok, tv, p = fits(torch.bincount(first * V + second, minlength=V * V), p0[:, None] * pm)
    assert ok, (tv, p)
    # Drafting must actually be exercised: some rounds accept something, some reject at the root.
    assert 0.05 < accepted[:, 1:].any(1).float().mean() < 0.999


def test_sampling_chain_draft_close_to_target_accepts_often():
    # Sanity that the acceptance rate tracks draft quality (and the rule is not "always reject").
    g = gen(21)
    p0, pm = random_rows(g), random_rows(g, V)
    q0, qm = 0.9 * p0 + 0.1 / V, 0.9 * pm + 0.1 / V
    tokens, target, draft = draw_tree(TREES["chain"], p0, pm, q0, qm, "replacement", g)
    accepted, _ = accept_sampling_batched(T(TREES["chain"]), tokens, target, draft, True, g)
    # Acceptance rate at the root is 1 - TV(p, q) = 1 - 0.1 * TV(p0, uniform) >= 0.9.
    assert accepted[:, 1].float().mean() > 0.88


# ---- the statistic catches wrong rules ------------------------------------------------------------------------------


def depth1_rule(p, q, cand, g, conditional_q=True, residual_update=True, merge_duplicates=False):
    """Test-local rule for a root with k children (cand [B, k]); returns the first emitted token. The defaults are
    the correct rule; each flag reproduces a known mistake."""
    b, k = cand.shape
    rows = torch.arange(b)
    r = p.expand(b, V_SMALL).clone()
    left = q.expand(b, V_SMALL).clone()
    out = torch.full((b,), -1)
    for j in range(k):
        x = cand[:, j]
        seen = (cand[:, :j] == x[:, None]).any(1)
        live = out < 0
        if merge_duplicates:  # a repeat is dropped entirely, residual update included
            live &= ~seen
        qc = left / left.sum(1, keepdim=True) if conditional_q else q.expand(b, V_SMALL)
        take = live & ~seen & (torch.rand(b, generator=g) * qc[rows, x] < r[rows, x])
        out = torch.where(take, x, out)
        if residual_update:
            res = (r - qc).clamp_min(0)
            tot = res.sum(1, keepdim=True)
            r = torch.where((live & ~take)[:, None] & (tot > 0), res / tot.clamp_min(1e-30), r)
        left = left.scatter(1, x[:, None], 0.0)
    return torch.where(out >= 0, out, torch.multinomial(r, 1, generator=g).squeeze(1))


V_SMALL = 4
# p, q, k chosen (by exact enumeration) where each mistake is strongly biased (TV 0.39, 0.30, 0.14).
# Entries: p, q, k, children drawn with replacement, the correct rule's flags, the mistaken rule's flags.
WRONG_RULES = {
    "unconditional_q_without_replacement": (
        [0.31, 0.10, 0.09, 0.50], [0.87, 0.06, 0.05, 0.02], 2, False, {}, dict(conditional_q=False)),
    "no_residual_update": (
        [0.6, 0.2, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4], 3, True,
        dict(conditional_q=False), dict(conditional_q=False, residual_update=False)),
    "merged_duplicates_unconditional_q": (
        [0.31, 0.03, 0.03, 0.63], [0.19, 0.66, 0.02, 0.13], 3, True,
        dict(conditional_q=False), dict(conditional_q=False, merge_duplicates=True)),
}


@pytest.mark.parametrize("name", sorted(WRONG_RULES))
def test_statistic_rejects_wrong_rules_and_accepts_the_real_one(name):
    p_list, q_list, k, with_replacement, right_flags, wrong_flags = WRONG_RULES[name]
    p, q = T(p_list), T(q_list)
    g = gen(len(name))
    qb = q.expand(N_TRIALS, V_SMALL)
    if with_replacement:
        cand = torch.multinomial(qb, k, replacement=True, generator=g)
    else:
        cand = sample_without_replacement(qb, k, g)

    wrong = depth1_rule(p, q, cand, g, **wrong_flags)
    ok, tv, pval = fits(torch.bincount(wrong, minlength=V_SMALL), p)
    assert not ok and pval < 1e-6 and tv > 3 * math.sqrt(V_SMALL / N_TRIALS), (tv, pval)

    right = depth1_rule(p, q, cand, g, **right_flags)
    assert fits(torch.bincount(right, minlength=V_SMALL), p)[0]

    n = k + 1
    tokens = torch.cat([torch.zeros(N_TRIALS, 1, dtype=torch.long), cand], 1)
    rows = p.expand(N_TRIALS, n, V_SMALL)
    accepted, bonus = accept_sampling_batched(T([-1] + [0] * k), tokens, rows, q.expand(N_TRIALS, n, V_SMALL),
                                              with_replacement, g)
    first = torch.where(accepted[:, 1:].any(1), (tokens * accepted)[:, 1:].sum(1), bonus)
    ok, tv, pval = fits(torch.bincount(first, minlength=V_SMALL), p)
    assert ok, (tv, pval)


def test_iid_draws_with_duplicates_merged_are_lossless_under_the_conditional_rule():
    # The distinct tokens of i.i.d. draws, in first-occurrence order, are distributed like draws without
    # replacement, so merged duplicates + conditional q is lossless (the test-local rule), and so is passing the
    # raw i.i.d. draws with replacement=False: a repeat then has conditional q 0 and is skipped, i.e. merged.
    p_list, q_list, k = WRONG_RULES["merged_duplicates_unconditional_q"][:3]
    p, q = T(p_list), T(q_list)
    g = gen(31)
    cand = torch.multinomial(q.expand(N_TRIALS, V_SMALL), k, replacement=True, generator=g)
    merged = depth1_rule(p, q, cand, g, conditional_q=True, merge_duplicates=True)
    assert fits(torch.bincount(merged, minlength=V_SMALL), p)[0]
    tokens = torch.cat([torch.zeros(N_TRIALS, 1, dtype=torch.long), cand], 1)
    accepted, bonus = accept_sampling_batched(T([-1] + [0] * k), tokens, p.expand(N_TRIALS, k + 1, V_SMALL),
                                              q.expand(N_TRIALS, k + 1, V_SMALL), False, g)
    first = torch.where(accepted[:, 1:].any(1), (tokens * accepted)[:, 1:].sum(1), bonus)
    assert fits(torch.bincount(first, minlength=V_SMALL), p)[0]


def test_draft_probs_for_deterministic_candidates_is_biased_and_none_is_not():
    # The child is always the draft's argmax (token 0). Judging it against q as if it were drawn from q
    # over-emits it: P(0) = min(1, 0.25 / 0.7) ~ 0.357 instead of 0.25. The point-mass rule (None) is exact.
    p, q = T([0.25, 0.25, 0.25, 0.25]), T([0.7, 0.1, 0.1, 0.1])
    tokens = T([[3, 0]]).expand(N_TRIALS, 2)
    rows_p, rows_q = p.expand(N_TRIALS, 2, 4), q.expand(N_TRIALS, 2, 4)
    for draft, lossless in ((rows_q, False), (None, True)):
        accepted, bonus = accept_sampling_batched(T([-1, 0]), tokens, rows_p, draft, True, gen(41))
        first = torch.where(accepted[:, 1], 0, bonus)
        assert fits(torch.bincount(first, minlength=4), p)[0] == lossless


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_acceptance_on_cuda_matches_cpu_rules():
    dev = torch.device("cuda")
    parents, tokens = T([-1, 0, 0, 1, 2]), T([0, 5, 6, 7, 8])
    top = T([6, 7, 8, 1, 9])
    path, bonus = accept_greedy(parents.to(dev), tokens.to(dev), top.to(dev))
    assert path.device.type == "cuda" and (path.cpu().tolist(), bonus) == ([0, 2, 4], 9)
    target = one_hot_rows([6, 0, 8, 0, 9], 10).to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    path, bonus = accept_sampling(parents.to(dev), tokens.to(dev), target, None, False, g)
    assert (path.cpu().tolist(), bonus) == ([0, 2, 4], 9)
    path, bonus = accept_sampling(parents.to(dev), tokens.to(dev), target, target, True, g)
    assert (path.cpu().tolist(), bonus) == ([0, 2, 4], 9)
