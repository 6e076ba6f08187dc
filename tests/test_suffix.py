"""The suffix automaton behind the context and history drafts (swiftk.proposers.suffix), the trees the sources grow from it
(proposers.context / history) and Token Recycling's successor table (proposers.recycle), against brute force."""
import random
from collections import Counter

import pytest
import torch

from swiftk.errors import SwiftkError
from swiftk.proposers.base import Context, Estimates, best_first
from swiftk.proposers.context import ContextNgrams, node_key
from swiftk.proposers.history import SessionHistory
from swiftk.proposers.recycle import K, SuccessorTable, TokenRecycling
from swiftk.proposers.suffix import _WALK, SEPARATOR, Matcher, OutputHistory, SuffixIndex


def longest_earlier(seq):
    """Brute force: the longest suffix of seq that also ends at an earlier position."""
    L = len(seq)
    for n in range(L - 1, 0, -1):
        if any(seq[i:i + n] == seq[L - n:] for i in range(L - n)):
            return n
    return 0


def followers(seq, pattern, upto=None):
    """Brute force: token -> how often it followed an occurrence of pattern (within seq[:upto])."""
    s = seq if upto is None else seq[:upto]
    n = len(pattern)
    return Counter(s[i + n] for i in range(len(s) - n) if s[i:i + n] == pattern)


@pytest.mark.parametrize("seed", range(6))
def test_repeat_and_children_equal_brute_force_while_growing(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 9])
    seq = [rng.randrange(vocab) for _ in range(160)]
    ix, L = SuffixIndex(seq[:2]), 2
    while L < len(seq):
        step = rng.randint(1, 6)   # commits of several tokens at once, as after an accepted draft
        ix.extend(seq[L:L + step])
        L = min(L + step, len(seq))
        state, m = ix.repeat()
        assert m == longest_earlier(seq[:L])
        if m:
            got = {t: c for t, _, c in ix.children(state)}
            assert got == dict(followers(seq[:L], seq[L - m:L]))
    assert ix.n_states <= 2 * len(seq)   # bounded: at most two states per token


def test_children_rank_by_count_then_recency_and_skip_separators():
    seq = [1, 2, 5, 0, 1, 2, 7, 0, 1, 2, 7, 0, 1, 2, 6, 0, 1, 2, SEPARATOR, 1, 2]
    ix = SuffixIndex(seq)
    state, m = ix.repeat()
    assert m == 2
    assert [(t, c) for t, _, c in ix.children(state)] == [(7, 2), (6, 1), (5, 1)]   # 6 is more recent than 5


def test_continuations_run_past_any_fixed_n():
    """A 30-token span seen before continues for as long as it repeats (an n-gram index stops matching at n=4
    and copies from the most recent 4-gram, here a wrong one)."""
    rng = random.Random(1)
    span = [rng.randrange(1000) for _ in range(30)]
    decoy = span[-4:] + [4242]   # the last 4 tokens of the span, later followed by something else
    seq = span + [9] + decoy + span[:26]
    ix = SuffixIndex(seq)
    state, m = ix.repeat()
    assert m == 26
    path, s = [], state
    for _ in range(4):
        t, s, _ = ix.children(s)[0]
        path.append(t)
    assert path == span[26:30]


def test_counts_stay_exact_for_long_states_on_long_runs():
    """Appends update counts along at most _WALK suffix-link states: on a run of one token, states longer than
    that keep exact counts and transitions (only the shortest, most frequent ones saturate)."""
    n = 3 * _WALK
    ix = SuffixIndex([7] * n)
    state, m = ix.repeat()
    assert m == n - 1 and [t for t, _, _ in ix.children(state)] == [7]


@pytest.mark.parametrize("seed", range(4))
def test_matcher_finds_the_longest_suffix_of_another_sequence(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 6])
    text = [rng.randrange(vocab) for _ in range(120)]
    other = [rng.randrange(vocab) for _ in range(80)]
    m = Matcher(SuffixIndex(text))
    for i, t in enumerate(other):
        m.feed([t])
        cur = other[:i + 1]
        best = max((n for n in range(len(cur) + 1)
                    if any(text[j:j + n] == cur[len(cur) - n:] for j in range(len(text) - n + 1))), default=0)
        assert m.matched == best and m.fed == i + 1


def test_output_history_never_continues_across_outputs():
    h = OutputHistory()
    h.add([1, 2, 3])
    h.add([4, 5])
    src = SessionHistory(h)
    ctx = Context([0, 1, 2], 4, 0.0)
    assert [c.tokens for c in src.propose(ctx)] == [[3]]           # stops at the end of its output
    assert src.propose(Context([0, 1, 2, 3], 4, 0.0)) == []        # an output's last token: nothing follows it
    assert h.outputs == 2
    h.add([])
    assert h.outputs == 2
    with pytest.raises(SwiftkError, match="max_tokens"):
        OutputHistory(max_tokens=1)


def test_output_history_is_bounded_and_drops_whole_old_outputs():
    h = OutputHistory(max_tokens=40)
    rng = random.Random(0)
    outs = [[rng.randrange(100, 200) for _ in range(rng.randrange(1, 15))] for _ in range(50)]
    versions = set()
    for o in outs:
        h.add(o)
        versions.add(h.version)
        assert len(h) <= 40
        seq = h.index.tokens
        assert seq[-1] == SEPARATOR and seq[-len(o) - 1:-1] == o   # the newest output is kept whole
        parts = [p for p in " ".join(map(str, seq)).split(str(SEPARATOR)) if p.strip()]
        kept = [[int(x) for x in p.split()] for p in parts]
        assert kept == outs[outs.index(o) - len(kept) + 1:outs.index(o) + 1]
    assert len(versions) > 1   # trimmed (and rebuilt) at least once
    h.add(list(range(1000, 1100)))   # longer than the bound: its tail is kept
    assert h.index.tokens[-1] == SEPARATOR and h.index.tokens[-2] == 1099 and len(h) <= 40


def test_history_source_follows_a_rebuilt_history():
    h = OutputHistory(max_tokens=11)
    h.add([1, 2, 3, 4])
    src = SessionHistory(h)
    assert [c.tokens for c in src.propose(Context([9, 1, 2], 3, 0.0))] == [[3, 4]]
    h.add([5, 6, 7, 8, 9, 10])   # over the bound: the automaton is rebuilt without the first output
    assert src.propose(Context([9, 1, 2], 3, 0.0)) == []
    assert [c.tokens for c in src.propose(Context([9, 1, 2, 6], 3, 0.0))] == [[7, 8, 9]]


# ---------------------------------------------------------------- trees from the automaton
def test_context_tree_branches_by_frequency_with_estimates_the_gate_can_price():
    seq = [0, 1, 2, 5, 6, 3, 0, 1, 2, 7, 8, 4, 0, 1, 2, 7, 8, 9, 0, 1, 2]   # "0 1 2" went on 5 once, 7 twice
    src = ContextNgrams()
    chains = src.propose(Context(seq, 4, 0.0))
    by_first = {c.tokens[0]: c for c in chains}
    assert set(by_first) == {5, 7}
    assert by_first[7].tokens[:2] == [7, 8] and by_first[5].tokens[:2] == [5, 6]
    assert {tuple(c.tokens[:3]) for c in chains if c.tokens[0] == 7} == {(7, 8, 4), (7, 8, 9)}   # then a split
    assert by_first[7].probs[0] > by_first[5].probs[0]                     # the frequent branch is priced higher
    assert by_first[7].keys[0] == node_key(3, 2, 3) and by_first[5].keys[0] == node_key(3, 1, 3)
    assert by_first[7].keys[1] == node_key(4, 2, 2)                        # one token deeper: a longer match
    for c in chains:
        assert c.source == "ngram" and len(c.keys) == len(c.probs) == len(c.tokens)
        assert all(0 < p <= 0.9 for p in c.probs)


def test_context_tree_respects_depth_node_count_and_the_gate_floor():
    rng = random.Random(3)
    seq = [rng.randrange(4) for _ in range(400)]
    src = ContextNgrams()
    for k in (1, 3, 8):
        chains = src.propose(Context(seq, k, 0.0))
        assert chains and all(len(c.tokens) <= k for c in chains)
        nodes = {tuple(c.tokens[:d + 1]) for c in chains for d in range(len(c.tokens))}
        assert len(nodes) <= 2 * k
    for c in src.propose(Context(seq, 8, 0.05)):
        v = 1.0
        for p in c.probs:
            v *= p
        assert v >= 0.05                                                   # nothing below the floor is built
    assert ContextNgrams().propose(Context([1, 2, 3], 4, 0.0)) == []      # no repeat, no draft


def test_best_first_keeps_the_likeliest_nodes_closed_under_ancestors():
    # a complete binary tree with p = 0.9 on the left child, 0.5 on the right
    def expand(h, depth):
        return [(2 * h, 2 * h, 0.9, 0), (2 * h + 1, 2 * h + 1, 0.5, 1)]

    chains = best_first(1, expand, 6, 10, 0.0, "t")
    nodes = {tuple(c.tokens[:d + 1]) for c in chains for d in range(len(c.tokens))}
    assert len(nodes) == 6
    # the left spine 0.9, 0.81, ..., 0.53 beats every right child (0.5 at best): six left steps
    assert nodes == {(2, 4, 8, 16, 32, 64)[:d] for d in range(1, 7)}
    assert {tuple(c.probs) for c in chains} == {(0.9,) * 6} and {tuple(c.keys) for c in chains} == {(0,) * 6}
    chains = best_first(1, expand, 8, 2, 0.0, "t")                         # depth 2: the whole tree, 6 nodes
    assert {tuple(c.tokens) for c in chains} == {(2, 4), (2, 5), (3, 6), (3, 7)}
    assert best_first(1, expand, 0, 10, 0.0, "t") == [] and best_first(1, expand, 5, 0, 0.0, "t") == []


# ---------------------------------------------------------------- Token Recycling
def test_successor_table_keeps_the_latest_top_k_per_token_in_bounded_memory():
    V = 50
    t = SuccessorTable(V)
    assert t.nbytes == V * K * 4 and t.row(3) == [-1] * K
    logits = torch.randn(2, V)
    t.update([3, 4], logits, [0, 1])
    assert t.row(3) == logits[0].topk(K).indices.tolist() and t.row(4) == logits[1].topk(K).indices.tolist()
    newer = torch.randn(1, V)
    t.update([3], newer, [0])                                              # the latest read of a token wins
    assert t.row(3) == newer[0].topk(K).indices.tolist()
    rows = torch.randn(5, V)                  # rows picked out of a pass, in path order; a token read twice: its last
    t.update([7, 8, 7], rows, [4, 0, 2])
    assert t.row(7) == rows[2].topk(K).indices.tolist() and t.row(8) == rows[0].topk(K).indices.tolist()
    with pytest.raises(SwiftkError, match="rows"):          # an index out of range writes nothing
        t.update([9, V], rows, [1, 1])
    assert t.row(9) == [-1] * K


def test_recycling_walks_the_table_best_first():
    V = 20
    t = SuccessorTable(V)
    top = torch.full((V, K), -1, dtype=torch.int32)
    top[1, :3] = torch.tensor([2, 3, 4])
    top[2, :2] = torch.tensor([5, 6])
    top[5, :1] = torch.tensor([7])
    t.put(torch.arange(V), top)
    src = TokenRecycling(t)
    chains = src.propose(Context([0, 1], 3, 0.0))
    paths = {tuple(c.tokens) for c in chains}
    assert (2, 5, 7) in paths and any(p[0] == 3 for p in paths)
    nodes = {p[:d + 1] for p in paths for d in range(len(p))}
    assert all(n[0] in (2, 3, 4) for n in nodes) and all(len(n) <= 3 for n in nodes)
    assert src.propose(Context([0, 9], 3, 0.0)) == []                      # a token never read: no draft
    # rank 0 is priced above rank 1 by the prior; learning moves it
    e = Estimates(TokenRecycling.prior)
    assert e.prob(0) > e.prob(1)
