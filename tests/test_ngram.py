"""Prompt-lookup drafting (swiftk.ngram): matching rules, branches, incremental index."""
import random

import pytest

from swiftk.errors import SwiftkError
from swiftk.ngram import NgramDraft, NgramIndex


def tokens_of(drafts):
    return [d.tokens for d in drafts]


def test_no_match():
    assert NgramIndex([1, 2, 3, 4]).propose(4) == []
    assert NgramIndex([]).propose(4) == []
    assert NgramIndex([7]).propose(4) == []


def test_basic_match_and_fields():
    idx = NgramIndex([5, 6, 7, 8, 9, 5, 6], max_n=3)
    assert idx.propose(3) == [NgramDraft([7, 8, 9], n=2, count=1)]


def test_match_ending_second_to_last_gives_last_token():
    # `3` occurs before only at the second-to-last position: the continuation is the last token itself.
    assert tokens_of(NgramIndex([1, 2, 3, 3]).propose(5)) == [[3]]
    # The current suffix is never its own match: nothing follows it yet.
    assert NgramIndex([1, 2, 3]).propose(5) == []


def test_overlapping_match():
    # a b a b a: suffix `b a` also ends at position 2; what follows runs into the suffix itself.
    a, b = 1, 2
    # The longest suffix with an earlier end is `a b a` (ends at 2); `b a b a` occurs only as the suffix.
    d = NgramIndex([a, b, a, b, a], max_n=4).propose(4)[0]
    assert (d.n, d.tokens) == (3, [b, a])


def test_overlapping_match_lengths():
    a, b = 1, 2
    d = NgramIndex([a, b, a, b, a], max_n=2).propose(4)[0]
    assert (d.n, d.tokens) == (2, [b, a])
    cyc = NgramIndex([a, b, a, b, a], max_n=2, cyclic=True).propose(5)[0]
    assert (cyc.n, cyc.tokens) == (2, [b, a, b, a, b])  # the period continues past the end
    run = NgramIndex([9, 9, 9], max_n=2, cyclic=True).propose(4)[0]
    assert run.tokens == [9, 9, 9, 9]


def test_longest_n_preferred():
    # `4` alone last followed by 50; `3 4` last followed by 60: the 2-gram wins.
    seq = [3, 4, 60, 0, 4, 50, 0, 3, 4]
    d = NgramIndex(seq, max_n=3).propose(1)
    assert d == [NgramDraft([60], n=2, count=1)]
    d1 = NgramIndex(seq, max_n=1).propose(1)
    assert d1 == [NgramDraft([50], n=1, count=1)]  # unigram only: the most recent occurrence


def test_branches_distinct_first_tokens():
    # After `0 1`: 2 twice (most recent), 3 once. After `1` alone, also 4 (at the very start).
    seq = [1, 4, 0, 1, 3, 0, 1, 2, 0, 1, 2, 9, 0, 1]
    idx = NgramIndex(seq, max_n=3)
    drafts = idx.propose(2, branches=5)
    firsts = [d.tokens[0] for d in drafts]
    assert len(set(firsts)) == len(firsts)
    # Longest n first, most recent first within one n; count = occurrences followed by that first token.
    assert [(d.tokens, d.n, d.count) for d in drafts] == [([2, 9], 2, 2), ([3, 0], 2, 1), ([4, 0], 1, 1)]
    assert idx.propose(2, branches=2) == drafts[:2]
    assert idx.propose(2, branches=1) == drafts[:1]


def test_branches_fall_back_to_shorter_n():
    # `5 6` was followed by 7 only; `6` alone was also followed by 8: the second branch comes from n=1.
    seq = [5, 6, 7, 0, 6, 8, 0, 5, 6]
    drafts = NgramIndex(seq, max_n=2).propose(1, branches=3)
    assert [(d.tokens, d.n) for d in drafts] == [([7], 2), ([8], 1)]


def test_k_caps_length():
    seq = list(range(20)) + [0, 1]
    idx = NgramIndex(seq)
    for k in range(1, 10):
        assert idx.propose(k)[0].tokens == list(range(2, 2 + k))
    assert idx.propose(0) == []


def test_positions_are_capped():
    idx = NgramIndex([1, 2] * 100, max_positions=4)
    assert all(len(d) <= 4 for d in idx._ends.values())
    # The most recent match ends two tokens before the end: the draft stops there (cyclic=False).
    assert idx.propose(3)[0].tokens == [1, 2]


def test_bad_args():
    with pytest.raises(SwiftkError):
        NgramIndex(max_n=2, min_n=3)
    with pytest.raises(SwiftkError):
        NgramIndex(min_n=0)


def _reference(seq, k, max_n, min_n):
    """Brute force for branches=1 with unbounded positions: longest n, then most recent earlier end."""
    L = len(seq)
    for n in range(max_n, min_n - 1, -1):
        if n > L - 1:
            continue
        suffix = seq[L - n :]
        for p in range(L - 2, n - 2, -1):
            if seq[p - n + 1 : p + 1] == suffix:
                return seq[p + 1 : p + 1 + k], n
    return None


@pytest.mark.parametrize("seed", range(4))
def test_incremental_equals_scratch_and_reference(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 8])
    seq = [rng.randrange(vocab) for _ in range(300)]
    inc = NgramIndex(seq[:3], max_n=4, min_n=1)
    big = NgramIndex(seq[:3], max_n=4, min_n=1, max_positions=10_000)
    L = 3
    while L < len(seq):
        step = rng.randint(1, 7)  # commits of several tokens at once, as after an accepted draft
        inc.extend(seq[L : L + step])
        big.extend(seq[L : L + step])
        L = min(L + step, len(seq))
        k, br = rng.randint(1, 6), rng.randint(1, 4)
        assert inc.propose(k, br) == NgramIndex(seq[:L], max_n=4, min_n=1).propose(k, br)
        ref = _reference(seq[:L], k, 4, 1)
        got = big.propose(k)
        assert (got[0].tokens, got[0].n) == ref if ref else got == []


# ---------------------------------------------------------------- the session's earlier outputs


def test_lookup_continues_another_texts_suffix():
    idx = NgramIndex([9, 1, 2, 3, 4, 1, 2, 7], max_n=3)
    assert idx.lookup([5, 1, 2], 4) == NgramDraft([7], n=2, count=1)            # most recent occurrence wins
    assert idx.lookup([0, 3], 3).tokens == [4, 1, 2] and idx.lookup([0, 3], 3).n == 1
    assert idx.lookup([5, 6], 3) is None and idx.lookup([7], 3) is None          # unseen / nothing follows
    # "4 1 2" and the recent "1 2" are followed by the stop token only: the older "1 2" continues
    assert idx.lookup([4, 1, 2], 9, stop=7) == NgramDraft([3, 4, 1, 2], n=2, count=1)


def test_output_history_never_continues_across_outputs():
    from swiftk.ngram import OutputHistory

    h = OutputHistory()
    assert h.propose([1, 2], 4) is None
    h.add([1, 2, 3])
    h.add([4, 5])
    assert h.propose([0, 1, 2], 4).tokens == [3]                  # stops at the end of its output
    assert h.propose([3], 4) is None                              # an output's last token: nothing follows it
    assert h.propose([8, 4], 4).tokens == [5] and h.outputs == 2
    h.add([])
    assert h.outputs == 2 and h.propose([4], 0) is None
    with pytest.raises(SwiftkError, match="max_tokens"):
        OutputHistory(max_tokens=1)


def test_output_history_is_bounded_and_drops_whole_old_outputs():
    from swiftk.ngram import SEPARATOR, OutputHistory

    h = OutputHistory(max_tokens=40)
    rng = random.Random(0)
    outs = [[rng.randrange(100, 200) for _ in range(rng.randrange(1, 15))] for _ in range(50)]
    for o in outs:
        h.add(o)
        assert len(h) <= 40
        seq = h.index.tokens
        assert seq[-1] == SEPARATOR and seq[-len(o) - 1:-1] == o   # the newest output is kept whole
        # whatever is kept is a run of whole outputs, newest last
        parts = [p for p in " ".join(map(str, seq)).split(str(SEPARATOR)) if p.strip()]
        kept = [[int(x) for x in p.split()] for p in parts]
        assert kept == outs[outs.index(o) - len(kept) + 1:outs.index(o) + 1]
    h.add(list(range(1000, 1100)))   # longer than the bound: its tail is kept
    assert h.index.tokens[-1] == SEPARATOR and h.index.tokens[-2] == 1099 and len(h) <= 40
