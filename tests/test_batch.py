"""Continuous batching: several calls' rounds in one target pass, with outputs identical to each call decoded alone.

The property under test is batch invariance across requests: a row's logits do not depend on the rows of other
requests in its pass, so every request's tokens equal plain autoregressive decoding of it alone, whatever shares
its passes, joins or leaves."""
import copy
import threading

import pytest
import torch

import swiftk
from swiftk.decoding.gate import Beside, Gate
from swiftk.target.costs import CostModel
from swiftk.errors import SwiftkError
from swiftk.options import DecodeConfig
from swiftk.runtime.kvcache import kv_dtype
from swiftk.runtime.model import Rows
from swiftk.runtime.ops import cpu_linear
from swiftk.runtime.ops.masks import TreeMask
from swiftk.scheduler import Scheduler

PROMPTS = ["def quicksort(arr):", "class Stack:\n    def __init__(self):", "Once upon a time",
           "import os\n\ndef walk(path):\n    for root, dirs, files in os.walk(path):",
           "The three primary colours are", "def fib(n):\n    if n < 2:\n        return n\n"]
REPEATS = "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(10):\n"
LONG = "# a long prompt that prefills in chunks beside the others\n" + "x = [i * i for i in range(10)]\n" * 20


@pytest.fixture(scope="module")
def eng(smollm2_path):
    return swiftk.load(str(smollm2_path), persist=False)


def _ar(eng, prompt, n, **kw):
    return eng.generate(prompt, max_new_tokens=n, method="autoregressive", **kw).token_ids


# ---- the runtime: one pass over several sequences -------------------------------------------------------------
def _parts(m, caches):
    """A tree on cache 0, a plain step on cache 1, a prefill chunk (logits of its last row only) on cache 2."""
    n0, n1, n2 = (c.length for c in caches)
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 1, 2])
    return [Rows(torch.tensor([5, 6, 7, 8]), n0 + depth, torch.arange(n0, n0 + 4), caches[0], TreeMask(n0, None, anc)),
            Rows(torch.tensor([11]), torch.tensor([n1]), torch.tensor([n1]), caches[1]),
            Rows(torch.arange(1, 71), torch.arange(n2, n2 + 70), torch.arange(n2, n2 + 70), caches[2], None,
                 torch.tensor([69]))]


# the file's blocks (float16 cache by default, or float32 asked for) and float32 weights (a float32 cache)
@pytest.mark.parametrize("weights,kv,cache_dtype", [(None, None, torch.float16), (None, "float32", torch.float32),
                                                    ("float32", None, torch.float32)])
def test_a_batched_pass_equals_each_sequence_alone_bit_for_bit(smollm2_path, weights, kv, cache_dtype):
    """Rows of three sequences (a tree, a plain step, a 70-row prefill chunk; different context lengths) in one pass:
    each part's logits and KV equal its own pass's, bit for bit (over float32 or float16 caches)."""
    if not cpu_linear.available():
        pytest.skip("the batched pass is the fused CPU loop's")
    e = swiftk.load(str(smollm2_path), persist=False, weights=weights, datastore=False, kv_cache=kv)
    m, tok = e.model, e.tokenizer
    caches = [m.new_cache(e.cache.max_slots) for _ in range(3)]
    for c, p in zip(caches, ["def f(x):", "Once upon a time there was", "import numpy as np\n" * 12]):
        ids = tok.encode(p)
        pos = torch.arange(len(ids))
        m.forward(torch.tensor(ids), pos, pos, c)
        c.advance(len(ids))
    twins = [copy.deepcopy(c) for c in caches]
    alone = [m.forward(p.tokens, p.positions, p.slots, p.cache, attn_mask=p.mask, logits_idx=p.logits_idx)
             for p in _parts(m, caches)]
    together = m.forward_batch(_parts(m, twins))
    for a, b in zip(alone, together):
        assert a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert all(torch.equal(a.data, b.data) for a, b in zip(caches, twins))
    assert caches[0].data.dtype == cache_dtype


def test_forward_batch_refuses_two_parts_on_one_cache(eng):
    c = eng.cache
    r = Rows(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), c)
    with pytest.raises(SwiftkError, match="cache of its own"):
        eng.model.forward_batch([r, r])


# ---- calls decoded together -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["swift", "autoregressive", "ngram"])
def test_generate_many_equals_each_call_alone(eng, method):
    """Six prompts (one of them prefilled in chunks beside the others), three slots: calls join as others finish,
    and every call's tokens equal autoregressive decoding alone."""
    prompts = PROMPTS + [LONG]
    want = [_ar(eng, p, 40) for p in prompts]
    got = eng.generate_many(prompts, max_new_tokens=40, max_batch=3, method=method)
    assert [r.token_ids for r in got] == want
    assert all(r.finish_reason in ("length", "eos") for r in got)
    assert got[0].stats.method == method and got[0].stats.new_tokens == len(want[0])


def test_a_float16_cache_decodes_losslessly_alone_and_batched(smollm2_path):
    """kv_cache="float16" is its own numerical model: speculation and batching equal its plain decoding, token for
    token; a bad value or a 16-bit cache under float32 compute on a GPU is refused by name."""
    e = swiftk.load(str(smollm2_path), persist=False, weights="float32", kv_cache="float16")
    assert e.cache.data.dtype == torch.float16 and "float16 KV cache" in e.model.arithmetic()
    want = [_ar(e, p, 40) for p in PROMPTS[:4]]
    assert [e.generate(p, max_new_tokens=40).token_ids for p in PROMPTS[:4]] == want
    assert [r.token_ids for r in e.generate_many(PROMPTS[:4], max_new_tokens=40, max_batch=3)] == want
    with pytest.raises(SwiftkError, match="kv_cache='int4'"):
        swiftk.load(str(smollm2_path), persist=False, kv_cache="int4")
    with pytest.raises(SwiftkError, match="runs on the CPU only"):   # checked before any CUDA is touched
        kv_dtype("float16", torch.device("cuda"), torch.float32)


def test_seeded_sampling_in_a_batch_equals_alone(eng):
    got = eng.generate_many(PROMPTS[:4], max_new_tokens=32, max_batch=4, temperature=0.9, top_p=0.95, seed=7)
    assert [r.token_ids for r in got] == [_ar(eng, p, 32, temperature=0.9, top_p=0.95, seed=7) for p in PROMPTS[:4]]


def test_stops_and_lengths_leave_the_batch_mid_way(eng):
    """Requests with their own lengths and stop strings, submitted to one scheduler: each ends where it would alone
    and the rest go on."""
    lens = [5, 40, 17, 33, 1, 26]
    reqs = [eng.calls.request(p, max_new_tokens=n, stop=["\n\n"] if i % 2 else ()) for i, (p, n) in
            enumerate(zip(PROMPTS, lens))]
    want = [eng.generate(p, max_new_tokens=n, method="autoregressive", stop=["\n\n"] if i % 2 else ())
            for i, (p, n) in enumerate(zip(PROMPTS, lens))]
    got: dict = {}
    with eng.calls.hold():
        s = Scheduler(eng.calls, 4)
        for i, r in enumerate(reqs):
            s.submit(r, lambda res, err, i=i: got.__setitem__(i, (res, err)))
        s.run_until_idle()
    for i, w in enumerate(want):
        res, err = got[i]
        assert err is None and (res.token_ids, res.text, res.finish_reason) == (w.token_ids, w.text, w.finish_reason)


def test_a_request_that_waited_for_a_slot_reports_its_queue_time(eng):
    """One slot, two requests made together: the second opens only after the first closed, so its queue time covers
    the first's whole decode; the first waited for nothing."""
    a, b = eng.generate_many(PROMPTS[:2], max_batch=1, max_new_tokens=12, method="autoregressive")
    assert a.stats.queue_time_s < b.stats.queue_time_s
    assert b.stats.queue_time_s >= a.stats.wall_time_s > 0


def test_a_failing_or_cancelled_call_leaves_the_others_unchanged(eng):
    """One request's proposer raises, another is cancelled after a few tokens: they end (with the error, or
    finish_reason "cancelled") and the others' tokens are those they get alone. The proposer raises the first time
    it is consulted: whether later rounds of a batch consult it depends on the pass costs measured as it runs (a
    fifth consultation did not always come within 30 tokens on a loaded machine)."""
    class Breaks:
        calls = 0

        def propose(self, tokens):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("proposer broke")
            return []

    cancel = threading.Event()
    seen = []

    def cb(piece):
        seen.append(piece)
        if len(seen) == 3:
            cancel.set()

    reqs = [eng.calls.request(PROMPTS[0], max_new_tokens=30, proposers=[Breaks()]),
            eng.calls.request(PROMPTS[1], max_new_tokens=30, callback=cb, _cancel=cancel),
            eng.calls.request(PROMPTS[2], max_new_tokens=30), eng.calls.request(PROMPTS[3], max_new_tokens=30)]
    got: dict = {}
    with eng.calls.hold():
        s = Scheduler(eng.calls, 4)
        for i, r in enumerate(reqs):
            s.submit(r, lambda res, err, i=i: got.__setitem__(i, (res, err)))
        s.run_until_idle()
    assert isinstance(got[0][1], SwiftkError) and "proposer broke" in str(got[0][1]) and got[0][0] is None
    assert got[1][0].finish_reason == "cancelled" and len(got[1][0].token_ids) < 30
    assert [got[i][0].token_ids for i in (2, 3)] == [_ar(eng, PROMPTS[i], 30) for i in (2, 3)]


def test_generate_many_checks_every_prompt_first(eng):
    with pytest.raises(SwiftkError, match="max_new_tokens"):
        eng.generate_many(PROMPTS[:2] + [""], max_new_tokens=0)
    with pytest.raises(SwiftkError, match="prompt is empty"):
        eng.generate_many(PROMPTS[:2] + [""], max_new_tokens=4)
    for bad in (0, 65, True, 2.0):
        with pytest.raises(SwiftkError, match="max_batch"):
            eng.generate_many(PROMPTS[:2], max_batch=bad)
    with pytest.raises(SwiftkError, match="list of prompts"):
        eng.generate_many("one prompt")
    with pytest.raises(SwiftkError, match="callback"):
        eng.generate_many(PROMPTS[:2], callback=print)


def test_logprobs_are_the_same_alone_speculating_and_batched(eng):
    """logprobs=K: each token's log-probability and its K likeliest alternatives come from the scores that chose it,
    which are batch invariant: the reference, the default (speculating) and a batch give the same numbers, greedy
    and seeded."""
    prompts = [PROMPTS[0], REPEATS]
    for kw in ({}, dict(temperature=0.8, seed=3)):
        ar = [eng.generate(p, max_new_tokens=24, method="autoregressive", logprobs=3, **kw) for p in prompts]
        # speculate="always": every round drafts, whatever this machine's timings make the gate decide
        spec = [eng.generate(p, max_new_tokens=24, logprobs=3, speculate="always", **kw) for p in prompts]
        many = eng.generate_many(prompts, max_new_tokens=24, logprobs=3, **kw)
        assert sum(r.stats.rounds for r in spec) > 0
        for a, b, c in zip(ar, spec, many):
            assert a.token_ids == b.token_ids == c.token_ids
            assert a.logprobs == b.logprobs == c.logprobs and len(a.logprobs) == len(a.token_ids)
            assert all(len(e["top"]) == 3 and e["top"][0][1] >= e["logprob"] for e in a.logprobs)
            if not kw:   # greedy: the chosen token is the likeliest
                assert all(e["top"][0][0] == e["token_id"] for e in a.logprobs)
    assert eng.generate(PROMPTS[0], max_new_tokens=4).logprobs is None
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(SwiftkError, match="logprobs"):
            eng.generate(PROMPTS[0], max_new_tokens=4, logprobs=bad)


# ---- a fresh engine's batch drafts; memory for the calls there are ------------------------------------------------
def test_a_fresh_engines_batch_drafts_and_consults_proposers(smollm2_path):
    """No call alone has timed a plain step: the batch's own passes price the drafts, so generate_many drafts from
    its first rounds (it never did), user proposers are consulted, and one that raises or calls back into the
    engine fails the call as it does in generate()."""
    fresh = lambda: swiftk.load(str(smollm2_path), persist=False, datastore=False)   # noqa: E731

    class Echo:
        calls = 0

        def propose(self, tokens):
            self.calls += 1
            return tokens[-8:]

    e, echo = fresh(), Echo()
    outs = e.generate_many([REPEATS, PROMPTS[0]], max_new_tokens=24, speculate="always", proposers=[echo])
    assert echo.calls > 0
    assert sum(o.stats.rounds for o in outs) > 0 and outs[0].stats.accepted_by_source["ngram"] > 0
    assert [o.token_ids for o in outs] == [_ar(e, p, 24) for p in (REPEATS, PROMPTS[0])]

    class Raises:
        def propose(self, tokens):
            raise RuntimeError("proposer broke")

    with pytest.raises(SwiftkError, match="proposer broke"):
        fresh().generate_many([REPEATS, PROMPTS[0]], max_new_tokens=16, proposers=[Raises()])
    e = fresh()

    class Reenters:
        def propose(self, tokens):
            return e.generate("x", max_new_tokens=2).token_ids

    with pytest.raises(SwiftkError, match="call back into the same engine"):
        e.generate_many([REPEATS, PROMPTS[0]], max_new_tokens=16, proposers=[Reenters()])


def test_batch_kv_memory_is_sized_to_the_prompts_and_refused_when_it_cannot_fit(smollm2_path, monkeypatch):
    """generate_many of 2 prompts at max_batch=64 makes 2 KV caches, not 64; more caches than the memory available
    are refused with a SwiftkError saying how many fit, before any decoding; the server the same at start."""
    e = swiftk.load(str(smollm2_path), persist=False, datastore=False)
    e.generate_many(PROMPTS[:2], max_new_tokens=4, max_batch=64)
    assert len(e.slots) == 2
    e.generate_many(PROMPTS[2:5], max_new_tokens=4, max_batch=64)
    assert len(e.slots) == 3
    import swiftk.requests as rq
    monkeypatch.setattr(rq, "available_memory", lambda: int(2.5 * e.slots.slot_bytes))
    with pytest.raises(SwiftkError, match=r"needs 5 more KV cache\(s\).*\b2 more fit"):
        e.generate_many(PROMPTS[:8] * 2, max_new_tokens=4, max_batch=8)
    assert len(e.slots) == 3
    from swiftk.serve.app import Server
    with pytest.raises(SwiftkError, match="--max-batch 16 needs 13 more"):
        Server(e, "m", max_batch=16)
    # the allocator's own refusal, as a batch slot is made, is worded too
    monkeypatch.setattr(rq, "available_memory", lambda: 1 << 40)
    monkeypatch.setattr(e.model, "new_cache", lambda n: (_ for _ in ()).throw(
        RuntimeError("DefaultCPUAllocator: can't allocate memory")))
    with pytest.raises(SwiftkError, match="cannot allocate the KV cache of batch slot 3"):
        e.generate_many(PROMPTS[:4], max_new_tokens=4)


# ---- pricing a draft row at the pass size at hand -------------------------------------------------------------
def test_a_node_that_pays_alone_may_not_pay_in_a_full_pass(eng):
    """The gate keeps the nodes that raise the pass's tokens per second. Each row costs 0.2 of a step: alone, a node
    of value 0.45 pays (2.09 tokens a step with it, 2.07 without); beside 2 other calls' rows expected to yield 2
    tokens it does not (2.68 against 2.72), and beside 8 no node clears the margin a shared pass asks."""
    costs = CostModel(eng.model)
    costs.step, costs.slope, costs.pairs = 0.01, 0.2, False
    gate = Gate(costs, eng.new_state().gate, DecodeConfig().validate())
    values = [1.0, 0.9, 0.45]
    sizes = []
    for beside in (Beside(0, 0.0), Beside(2, 2.0), Beside(8, 8.0)):
        sizes.append(gate.tree_size(0.0, values, beside))
    assert sizes == [3, 2, 0]
    assert gate.tree_size(0.0, values) == 3   # alone, as the first
    # priced by the batch's own passes instead: 2 ms of weight reads and 2.5 ms a row (int8 rows on AVX2) -- beside
    # 3 rows expected to yield 3 tokens, not even a certain node pays
    assert gate.tree_size(0.0, [1.0, 1.0], Beside(3, 3.0, lambda T: 0.002 + 0.0025 * T)) == 0


def test_a_prompt_start_being_prefilled_is_copied_not_prefilled_again(smollm2_path):
    """Three choices of one long prompt and a prompt sharing its start: the later calls wait for the first one's
    prefill, copy its KV (prompt_reused counts it) and decode the tokens each decodes alone."""
    e = swiftk.load(str(smollm2_path), persist=False)
    other = LONG + "y = 3\n"
    want = [_ar(e, p, 24, prefix_cache=False) for p in (LONG, other)]
    n = len(e.encode_prompt(LONG))
    got = e.generate_many([LONG, LONG, LONG, other], max_new_tokens=24, max_batch=4, temperature=0)
    assert [r.token_ids for r in got] == [want[0]] * 3 + [want[1]]
    assert got[0].stats.prompt_reused == 0
    assert [r.stats.prompt_reused for r in got[1:3]] == [n - 1, n - 1]   # all but the last prompt token
    assert got[3].stats.prompt_reused >= n // 2
    seeded = e.generate_many([LONG] * 2, max_new_tokens=24, max_batch=2, temperature=0.8, seed=5)
    assert seeded[0].token_ids == e.generate(LONG, max_new_tokens=24, temperature=0.8, seed=5,
                                             prefix_cache=False).token_ids
    off = e.generate_many([LONG, LONG], max_new_tokens=4, max_batch=2, prefix_cache=False)   # reuse off: no copy
    assert [r.stats.prompt_reused for r in off] == [0, 0]
