"""Corpus n-gram drafting (swiftk/proposers/datastore.py): the tables, their file, and their drafts in the decode loop."""
import numpy as np
import pytest
import torch

import swiftk
from swiftk.proposers.datastore import CONF_BINS, MAX_N, Datastore, bucket
from swiftk.errors import SwiftkError
from swiftk.decoding.tree import Chain, build_tree

NGRAM, DATASTORE = "ngram", "datastore"


def brute(corpus, ctx, min_count=2):
    """The longest suffix of ctx (<= MAX_N) seen >= min_count times in corpus, and its most frequent follower."""
    for n in range(min(MAX_N, len(ctx)), 0, -1):
        follow = {}
        for i in range(n - 1, len(corpus) - 1):
            if corpus[i - n + 1:i + 1] == ctx[-n:]:
                follow[corpus[i + 1]] = follow.get(corpus[i + 1], 0) + 1
        tot = sum(follow.values())
        if tot >= min_count:
            best = min(follow, key=lambda t: (-follow[t], t))
            return best, n, follow[best] / tot
    return None


def test_lookup_matches_a_brute_force_count_on_random_text():
    rng = np.random.default_rng(0)
    corpus = rng.integers(0, 12, 3000).tolist() + [70000, 5, 6, 70000, 5, 7, 70000, 5, 6]
    ds = Datastore.build(corpus)
    for _ in range(300):
        ctx = rng.integers(0, 13, 4).tolist()
        assert ds.lookup(ctx) == brute(corpus, ctx), ctx
    # longest match wins; ties go to the lower token id; a follower seen once is no key (MIN_COUNT)
    assert ds.lookup([70000, 5]) == (6, 2, 2 / 3)
    assert ds.lookup([99]) is None and ds.lookup([]) is None
    assert Datastore.build([1, 2, 3]).lookup([1]) is None


def test_propose_continues_greedily_and_reports_buckets():
    corpus = [1, 2, 3, 4, 9] * 5 + [1, 2, 3, 5]
    ds = Datastore.build(corpus)
    toks, bks = ds.propose([7, 1, 2], 4)
    assert toks == [3, 4, 9, 1]
    assert bks[0] == bucket(2, 1.0) and bks[1] == bucket(3, 5 / 6)
    assert ds.propose([8], 4) == ([], []) and ds.propose([1, 2], 0) == ([], [])
    assert bucket(1, 0.0) == 0 and bucket(MAX_N, 1.0) == MAX_N * (len(CONF_BINS) + 1) - 1


def test_the_compiled_walk_is_the_python_walk():
    """kernels/cpu/cpu_ngram.cpp against Datastore.walk: random corpora and contexts (ids outside the tables'
    range, unseen tokens, short contexts), with and without estimates and a floor, tables without 3-grams."""
    from swiftk.runtime.ops import cpu_linear

    if not cpu_linear.available():
        pytest.skip(f"no kernel library: {cpu_linear.status()}")
    rng = np.random.default_rng(1)
    for trial in range(6):
        corpus = rng.integers(0, 6 + 4 * trial, 2500).tolist()
        ds = Datastore.build(corpus, max_n=2 if trial == 5 else MAX_N)
        assert ds._compiled(), "the compiled walk is not used (the library is loaded)"
        for _ in range(200):
            ctx = rng.integers(-1, 30, int(rng.integers(0, 5))).tolist()
            if rng.random() < 0.1:
                ctx[-1:] = [1 << 40]   # past the 21-bit ids (and past int32): the chain ends, nothing crashes
            k = int(rng.integers(0, 12))
            table = rng.random(12).tolist()
            for prob, floor in ((None, 0.0), (table.__getitem__, 0.0), (table.__getitem__, float(rng.random()) / 4)):
                assert ds.propose(ctx, k, prob, floor) == ds.walk(ctx, k, prob, floor), (trial, ctx, k, floor)
    empty = Datastore.build([1, 2])
    assert empty.propose([1], 4) == empty.walk([1], 4) == ([], [])


def test_the_walk_never_builds_the_kernel_library(monkeypatch):
    """A corpus source on an engine that never loaded the CPU library (a GPU engine) walks in Python: building the
    library inside a decode call would stall it for tens of seconds."""
    from swiftk.runtime.ops import native

    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_why", None)
    monkeypatch.setattr(native, "_open", lambda: pytest.fail("built or loaded the library"))
    ds = Datastore.build([1, 2, 3, 4, 9] * 5)
    assert ds.propose([7, 1, 2], 4) == ([3, 4, 9, 1], ds.walk([7, 1, 2], 4)[1]) and ds._compiled() is False


def test_bad_corpus_is_rejected():
    with pytest.raises(SwiftkError, match="token ids"):
        Datastore.build([1, -2, 3])
    with pytest.raises(SwiftkError, match="token ids"):
        Datastore.build([1, 1 << 21])


def test_file_round_trip_and_corrupt_files(tmp_path, monkeypatch):
    ds = Datastore.build([1, 2, 3, 1, 2, 3, 1, 2, 4])
    p = tmp_path / "d.npz"
    ds.save(p)
    back = Datastore.load(p)
    assert back.lookup([1, 2]) == ds.lookup([1, 2]) and len(back) == len(ds)
    assert [f.name for f in tmp_path.iterdir()] == ["d.npz"]   # no temporary left behind
    p.write_bytes(b"not a zip")
    with pytest.raises(Exception):
        Datastore.load(p)
    # the cached stdlib tables: an unreadable file is rebuilt over, a good one read back
    import swiftk.proposers.datastore as dsm
    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(dsm, "stdlib_ids", lambda tok, n: [5, 6, 7, 5, 6, 8, 5, 6, 7])
    a = dsm.stdlib_datastore(None, "fp", 100, max_tokens=9)
    (f,) = (tmp_path / "home" / "datastore").iterdir()
    f.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match=f"rebuilding the corpus table {f}"):
        b = dsm.stdlib_datastore(None, "fp", 100, max_tokens=9)
    assert a.lookup([5, 6]) == b.lookup([5, 6]) == (7, 2, 2 / 3)
    assert Datastore.load(f, "fp", 100).lookup([5, 6]) == (7, 2, 2 / 3)


def test_tree_with_context_and_corpus_chains_shares_their_common_prefix():
    t = build_tree(100, [], 10, 16, "cpu", chains=[Chain([1, 2, 3], [0.9] * 3, NGRAM),
                                                   Chain([1, 2, 7, 8], [0.5] * 4, DATASTORE)])
    assert t.tokens.tolist() == [100, 1, 2, 3, 7, 8]
    assert t.parents.tolist() == [-1, 0, 1, 2, 2, 4]
    assert t.source[1:] == [NGRAM, NGRAM, NGRAM, DATASTORE, DATASTORE]
    # where two sources agree, the shared node takes the larger estimate (here the corpus's, added second)
    t = build_tree(100, [], 10, 16, "cpu", chains=[Chain([1, 2], [0.3] * 2, NGRAM), Chain([1, 5], [0.8] * 2,
                                                                                         DATASTORE)])
    assert t.tokens.tolist() == [100, 1, 2, 5] and t.value[1] == pytest.approx(0.8)
    assert t.value[2] == pytest.approx(0.3 * 0.3) and t.value[3] == pytest.approx(0.8 * 0.8)


@pytest.fixture
def eng(tiny_dir):
    torch.set_num_threads(1)
    return swiftk.load(str(tiny_dir), persist=False)


@pytest.mark.parametrize("sampling", [False, True])
def test_corpus_drafts_are_verified_like_any_draft(eng, sampling):
    """A corpus that holds the model's own continuation: its drafts are accepted, and the output is exactly plain
    decoding's (greedy; coupled sampling with a seed draws the same tokens whatever the drafts)."""
    kw = {"temperature": 0.8, "seed": 3} if sampling else {}
    prompt = "w3 w9 w1"
    ref = eng.generate(prompt, max_new_tokens=40, method="autoregressive", **kw)
    eng.use_corpus(Datastore.build((ref.prompt_ids + ref.token_ids) * 2))
    for method in ("ngram", "swift"):
        out = eng.generate(prompt, max_new_tokens=40, method=method, speculate="always", optimize=False, ngram=False,
                           history=False, recycle=False, **kw)
        assert out.token_ids == ref.token_ids
        assert out.stats.accepted_by_source["datastore"] > 0
        off = eng.generate(prompt, max_new_tokens=40, method=method, speculate="always", optimize=False,
                           ngram=False, datastore=False, **kw)
        assert off.token_ids == ref.token_ids and off.stats.accepted_by_source["datastore"] == 0


def test_corpus_estimates_learn_and_outlive_the_prompt(eng):
    """Misses lower a bucket's estimate (the gate stops paying for it); a new prompt keeps what was learned."""
    from swiftk.proposers import CorpusNgrams

    est = eng.state.source_estimates("datastore", CorpusNgrams.new_estimates)
    before = est.prob(3)
    for _ in range(10):
        est.observe(3, False)
    assert est.prob(3) < before / 2
    low = est.prob(3)
    eng.use_corpus(Datastore.build([]))   # a corpus that proposes nothing: the next prompt observes nothing
    eng.generate("w3 w9 w1", max_new_tokens=8)
    assert eng.state.source_estimates("datastore", CorpusNgrams.new_estimates) is est and est.prob(3) == low


def test_a_corpus_the_tokenizer_cannot_serve_leaves_decoding_without_it(tiny_dir, monkeypatch):
    """A custom tokenizer that fails on the corpus, or maps it past the model's vocabulary: a warning from the
    background build, no corpus drafts, output unchanged (the datastore is an optional source, never a reason for
    generate to fail)."""
    import swiftk.proposers.datastore as dsm

    monkeypatch.setattr(dsm, "cached_stdlib_datastore", lambda fp, vocab: None)
    monkeypatch.setattr(dsm, "stdlib_datastore", lambda tok, fp, vocab: Datastore.build([5, 999, 5, 999, 5]))
    eng = swiftk.load(str(tiny_dir), persist=False)
    ref = eng.generate("w3 w9 w1", max_new_tokens=12, method="autoregressive").token_ids
    with pytest.warns(UserWarning, match="corpus n-grams unavailable"):
        eng.corpus(wait=True)
    out = eng.generate("w3 w9 w1", max_new_tokens=12, method="ngram", speculate="always")
    assert out.token_ids == ref and out.stats.accepted_by_source["datastore"] == 0
    assert eng.corpus().max_token() == -1   # kept empty: not rebuilt at every call


def test_no_call_waits_for_the_corpus_tables(tiny_dir, monkeypatch):
    """Tables not built yet are built in the background from load on: a generate call meanwhile drafts without
    them and does not wait; once built they are used."""
    import threading

    import swiftk.proposers.datastore as dsm

    release = threading.Event()

    def slow(tok, fp, vocab):
        release.wait(30)
        return Datastore.build([3, 4, 5] * 4)

    monkeypatch.setattr(dsm, "cached_stdlib_datastore", lambda fp, vocab: None)
    monkeypatch.setattr(dsm, "stdlib_datastore", slow)
    eng = swiftk.load(str(tiny_dir), persist=False)
    out = eng.generate("w3 w9 w1", max_new_tokens=4, method="ngram", speculate="always")   # returns: no wait
    assert out.stats.accepted_by_source["datastore"] == 0 and eng.corpus().max_token() == -1
    release.set()
    assert eng.corpus(wait=True).max_token() == 5


@pytest.mark.parametrize("damage", ["id-past-vocab", "key-past-vocab", "empty", "other-tokenizer"])
def test_a_cached_table_that_disagrees_with_the_model_is_rebuilt_naming_it(tmp_path, monkeypatch, damage):
    """Tables that pass the format check but not the model that reads them (a proposed or key id >= its vocabulary,
    all arrays empty, another tokenizer's): one warning naming the file, from the caller's thread, then the tables
    are rebuilt and drafting from them is on, at this load and the next."""
    import warnings

    import swiftk.proposers.datastore as dsm

    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path))
    monkeypatch.setattr(dsm, "stdlib_ids", lambda tok, n: [5, 6, 7, 5, 6, 8, 5, 6, 7])
    good = dsm.stdlib_datastore(None, "fp", 100, max_tokens=9)
    (f,) = (tmp_path / "datastore").iterdir()
    t = {n: list(a) for n, a in good.tables.items()}
    if damage == "id-past-vocab":
        t[2][1] = t[2][1].copy()
        t[2][1][0] = 105
    elif damage == "key-past-vocab":
        t[1][0] = t[1][0].copy()
        t[1][0][-1] = 104
    elif damage == "empty":
        t = {n: [a[:0] for a in arrs] for n, arrs in t.items()}
    Datastore({n: tuple(a) for n, a in t.items()}).save(f, "another" if damage == "other-tokenizer" else "fp")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert dsm.cached_stdlib_datastore("fp", 100, max_tokens=9) is None   # rejected, removed
        again = dsm.stdlib_datastore(None, "fp", 100, max_tokens=9)            # rebuilt, no second warning
    msgs = [str(w.message) for w in seen]
    assert len(msgs) == 1 and f"rebuilding the corpus table {f}" in msgs[0], msgs
    assert again.lookup([5, 6]) == (7, 2, 2 / 3)
    assert dsm.cached_stdlib_datastore("fp", 100, max_tokens=9).lookup([5, 6]) == (7, 2, 2 / 3)


def test_a_truncated_table_warns_once_and_closes_its_file(tmp_path, monkeypatch):
    import warnings

    import swiftk.proposers.datastore as dsm

    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path))
    monkeypatch.setattr(dsm, "stdlib_ids", lambda tok, n: [5, 6, 7, 5, 6, 8, 5, 6, 7])
    dsm.stdlib_datastore(None, "fp", 100, max_tokens=9)
    (f,) = (tmp_path / "datastore").iterdir()
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dsm.stdlib_datastore(None, "fp", 100, max_tokens=9)
        import gc
        gc.collect()
    kinds = [(w.category.__name__, str(w.message)[:60]) for w in seen]
    assert [k for k, _ in kinds] == ["UserWarning"], kinds   # no ResourceWarning: the file was closed

