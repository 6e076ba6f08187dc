"""The speculative loop's contract on a tiny random llama: every option applied or rejected, the speed gate, coupled
sampling, one engine shared by threads, abandoned streams, the persisted state."""
import dataclasses
import json
import threading
import time

import pytest
import torch

import swiftk
import swiftk.decoding.loop as decode_mod
from swiftk.decoding.loop import Decoder
import swiftk.proposers.layerskip.draft as layerskip_mod
from swiftk.options import DecodeConfig, OptimizerConfig
from swiftk.target.costs import CostModel
from swiftk.errors import SwiftkError

PROMPT = "w3 w4 w5 w6 w7 w3 w4 w5"


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model is all per-op overhead
    yield
    torch.set_num_threads(n)


@pytest.fixture
def eng(tiny_dir):
    return swiftk.load(str(tiny_dir), persist=False)


def ar(eng, prompt=PROMPT, n=40, **kw):
    return eng.generate(prompt, max_new_tokens=n, method="autoregressive", **kw).token_ids


ALWAYS = {"speculate": "always", "eps": 0.0}


def test_every_decode_option_takes_effect_per_call(eng, monkeypatch):
    ref = ar(eng)
    out = eng.generate(PROMPT, max_new_tokens=40, max_draft=1, optimize=False, ngram=False, history=False, recycle=False, **ALWAYS)
    assert out.token_ids == ref and out.stats.drafted_tokens <= out.stats.rounds  # max_draft
    out = eng.generate(PROMPT, max_new_tokens=40, max_tree_nodes=3, optimize=False, trace=True, **ALWAYS)
    assert out.token_ids == ref and max(out.stats.tree_sizes) <= 3                 # max_tree_nodes
    assert out.stats.tree_sizes and out.stats.accept_lengths and out.stats.phases  # trace
    assert sum(out.stats.accept_lengths) / len(out.stats.accept_lengths) == pytest.approx(
        out.stats.mean_accepted_length)
    plain = eng.generate(PROMPT, max_new_tokens=40, max_tree_nodes=3, optimize=False, **ALWAYS).stats
    assert plain.rounds and not (plain.tree_sizes or plain.accept_lengths or plain.phases)
    out = eng.generate(PROMPT, max_new_tokens=40, optimize=False, ngram=False, history=False, recycle=False, speculate="always",
                       eps=1.0)
    assert out.token_ids == ref and out.stats.drafted_tokens == out.stats.rounds   # eps: stop after one step
    chains = eng.generate(PROMPT, max_new_tokens=40, optimize=False, ngram=False, history=False, recycle=False, max_draft=4,
                          topk_greedy=((0.0, 1),), trace=True, **ALWAYS)
    assert all(t <= 5 for t in chains.stats.tree_sizes)                            # topk_greedy: chains only
    ng = eng.generate(PROMPT, max_new_tokens=40, method="ngram", speculate="always")
    assert ng.token_ids == ref and ng.stats.skip_set is None                        # method="ngram": no layer draft
    out = eng.generate(PROMPT, max_new_tokens=40, ngram=False, optimize=False, **ALWAYS)
    assert out.stats.accepted_by_source["ngram"] == 0                               # ngram=False
    out = eng.generate(PROMPT, max_new_tokens=40, recycle=False, optimize=False, **ALWAYS)
    assert out.token_ids == ref and out.stats.accepted_by_source["recycle"] == 0    # recycle=False
    out = eng.generate(PROMPT, max_new_tokens=40, method="ngram", ngram=False, datastore=False, **ALWAYS)
    assert out.token_ids == ref and out.stats.accepted_by_source["history"] > 0     # earlier calls' outputs
    assert out.stats.accepted_by_source["ngram"] == 0                               # (ngram=False, method ngram)
    out = eng.generate(PROMPT, max_new_tokens=40, method="ngram", ngram=False, datastore=False, history=False,
                       recycle=False, **ALWAYS)
    assert out.token_ids == ref and out.stats.accepted_by_source["history"] == 0    # history=False
    assert out.stats.rounds == 0                                                    # no source left: plain steps
    from swiftk.proposers.datastore import Datastore
    eng.use_corpus(Datastore.build((eng.encode_prompt(PROMPT) + ref) * 2))   # a corpus that knows the answer
    on = eng.generate(PROMPT, max_new_tokens=40, method="ngram", ngram=False, history=False, recycle=False, **ALWAYS)
    off = eng.generate(PROMPT, max_new_tokens=40, method="ngram", ngram=False, history=False, recycle=False, datastore=False,
                       **ALWAYS)
    assert on.token_ids == off.token_ids == ref                                     # datastore
    assert on.stats.accepted_by_source["datastore"] > 0 == off.stats.accepted_by_source["datastore"]
    steps = eng.optimizer.steps
    eng.generate(PROMPT, max_new_tokens=60, optimize=False, **ALWAYS)
    assert eng.optimizer.steps == steps                                             # optimize=False
    seen = {}
    real_verify = decode_mod.verify

    def spy(model, cache, tree, levels, boundary):
        seen["boundary"] = boundary
        return real_verify(model, cache, tree, levels, boundary)

    monkeypatch.setattr(decode_mod, "verify", spy)
    eng.generate(PROMPT, max_new_tokens=12, method="early_exit", exit_layer=3, kvq=True, ngram=False, **ALWAYS)
    assert seen["boundary"] == 3                                                    # kvq
    seen.clear()   # without a boundary the round runs its verify pass as any other (verify() is KVQ's)
    eng.generate(PROMPT, max_new_tokens=12, method="early_exit", exit_layer=3, kvq=False, ngram=False, **ALWAYS)
    assert seen.get("boundary") is None
    rules = []
    real_accept = decode_mod.accept_tree
    monkeypatch.setattr(decode_mod, "accept_tree", lambda tree, t, rule=None, g=None: rules.append(rule)
                        or real_accept(tree, t, rule, g))
    real_nodes = decode_mod.accept_nodes   # coupled sampling's argmax rule on CPU scores, as host values
    monkeypatch.setattr(decode_mod, "accept_nodes", lambda tree, t: rules.append(None) or real_nodes(tree, t))
    eng.generate(PROMPT, max_new_tokens=12, temperature=0.8, seed=1, sampling="rejection", ngram=False, **ALWAYS)
    assert set(rules) == {"rejection"}                                               # sampling
    rules.clear()
    eng.generate(PROMPT, max_new_tokens=12, temperature=0.8, seed=1, **ALWAYS)
    assert rules and set(rules) == {None}
    # speculate: "always" drafts every round, "auto" is covered by the gate tests below


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(DecodeConfig)])
def test_bad_decode_option_values_are_rejected_naming_the_option(eng, field):
    bad = {"recycle": "yes", "max_draft": 0, "eps": float("nan"), "max_tree_nodes": 65, "topk_greedy": [[0.5, 0]],
           "topk_sampling": "x", "optimize": "no", "kvq": "no", "speculate": "sometimes", "ngram": 1,
           "sampling": "gumbel", "draft_vocab": -1, "datastore": "yes", "history": 0, "trace": "on",
           "prefix_cache": "yes"}[field]
    with pytest.raises(SwiftkError, match=field):
        eng.generate(PROMPT, max_new_tokens=4, **{field: bad})


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(OptimizerConfig)])
def test_optimizer_options_per_call_are_rejected_with_the_way_to_set_them(eng, field):
    value = getattr(OptimizerConfig(), field)
    with pytest.raises(SwiftkError, match=rf"reset_optimizer\({field}="):
        eng.generate(PROMPT, max_new_tokens=4, **{field: value})


def test_reset_optimizer_applies_optimizer_options(eng):
    L = eng.config.n_layers
    eng.reset_optimizer(skip_ratio=0.2, context_window=8, objective="matchness")
    assert eng.state.cfg.skip_ratio == 0.2 and eng.optimizer.skip_count == round(0.2 * 2 * L)
    assert int(eng.skip_set.sum()) == eng.optimizer.skip_count
    with pytest.raises(SwiftkError, match="decode option"):
        eng.reset_optimizer(max_draft=3)
    with pytest.raises(SwiftkError, match="context_window"):
        eng.reset_optimizer(context_window=300)
    with pytest.raises(SwiftkError, match="unknown option"):
        eng.generate(PROMPT, max_new_tokens=4, skip_rati=0.3)


class _Costs(CostModel):
    """A fake cost model: verification of more than one token is ``verify`` steps, a draft step ``draft``."""

    def __init__(self, model, verify, draft):
        super().__init__(model)
        self._vf, self._df = verify, draft

    def v(self, T):
        return (self.step or 1.0) * (1.0 if T <= 1 else self._vf)

    def draft(self, skip):
        return (self.step or 1.0) * self._df


def test_gate_takes_plain_steps_when_no_draft_can_pay(eng):
    ref = ar(eng, n=64)
    eng.target.costs = _Costs(eng.model, verify=50.0, draft=5.0)
    # free sources off: nodes riding on drafted rounds can make them measure faster than plain on this tiny
    # model whatever the fake cost model says (the gate trusts measured rates)
    out = eng.generate(PROMPT, max_new_tokens=64, optimize=False, trace=True, ngram=False, history=False,
                       recycle=False, datastore=False)
    assert out.token_ids == ref
    assert out.stats.plain_steps >= 0.8 * 64, (out.stats.plain_steps, out.stats.rounds)
    assert out.stats.drafted_tokens <= 12     # a few probes, spaced further apart each time they fail
    assert "plain" in out.stats.phases


def test_skip_set_search_runs_only_where_a_done_search_could_pay(eng):
    """A search step costs a matchness pass over a window: where even a set accepted at the search's stopping
    point (max_matchness) would not beat plain decoding, no step runs (small models on CPU blocks)."""
    ref = ar(eng, n=48)
    eng.target.costs = _Costs(eng.model, verify=3.0, draft=0.7)     # at 0.95 acceptance the best chain gives < 1.0
    assert eng.costs.expected_rate(0.95, 0.7) < 1.0 <= eng.costs.expected_rate(1.0, 0.05)
    out = eng.generate(PROMPT, max_new_tokens=48, state=eng.new_state(opt_budget=1.0), ngram=False, history=False,
                       recycle=False, datastore=False)
    assert out.token_ids == ref and out.stats.optimization_steps == 0 and out.stats.time_optimize_s == 0
    eng.target.costs = _Costs(eng.model, verify=1.0, draft=0.05)    # cheap drafts: the search runs (a call that saved
    # nothing may spend its whole time on it here: call_budget=1)
    out = eng.generate(PROMPT, max_new_tokens=48, state=eng.new_state(opt_budget=1.0, call_budget=1.0), ngram=False,
                       history=False, recycle=False, datastore=False)
    assert out.token_ids == ref and out.stats.optimization_steps > 0


def test_gate_drafts_when_drafting_is_free(eng):
    ref = ar(eng, n=64)
    eng.target.costs = _Costs(eng.model, verify=1.0, draft=0.01)
    out = eng.generate(PROMPT, max_new_tokens=64, optimize=False, trace=True)
    assert out.token_ids == ref
    # every round drafts (the first one is the plain step that measures a step) and, verification being free,
    # keeps more than the chain: siblings cost nothing
    assert out.stats.plain_steps <= 2 and out.stats.drafted_tokens >= out.stats.rounds - 1
    assert min(out.stats.tree_sizes) > 2


def test_tree_size_needs_a_margin_and_ngram_misses_are_learned_within_a_prompt(eng):
    """A verify pass must promise more than the cost model's error; two context misses at a key (a match length,
    a kind of continuation) stop it being verified on a CPU whose 2-token verify costs 1.3 steps."""
    from swiftk.decoding.gate import Gate
    from swiftk.proposers import ContextNgrams
    from swiftk.decoding.state import GateMemory

    c = CostModel(eng.model)
    c.step, c.verify = 1.0, {2: 1.3}
    gate = Gate(c, GateMemory(), DecodeConfig().validate())
    assert gate.tree_size(0.0, [0.35]) == 1          # (1 + 0.35) / 1.3: +3.8% predicted, worth a verify pass
    assert gate.tree_size(0.0, [0.33]) == 0          # +2.3%: within the model's error, a plain step instead
    assert gate.tree_size(0.0, [0.25]) == 0          # slower than plain
    from swiftk.proposers.context import node_key

    st, key = ContextNgrams().est, node_key(3, 1, 1)   # a 3-token match seen once before
    p0 = st.prob(key)
    for _ in range(2):
        st.observe(key, False)
    assert p0 > 0.33 and st.prob(key) < 0.3    # from worth verifying to not, in two misses
    st.observe(key, True)
    st.observe(key, True)
    assert st.prob(key) > 0.45                 # and back when the text starts repeating
    # below break-even a free chain is still verified now and then (a probe): it is how the estimate can recover
    gate = Gate(c, GateMemory(), DecodeConfig().validate())
    sizes = [gate.free_size(0.0, [0.1]) for _ in range(8)]
    assert sizes == [0, 0, 0, 1, 0, 0, 0, 1]
    gate.probed(False)
    assert [gate.free_size(0.0, [0.1]) for _ in range(8)] == [0] * 7 + [1]  # a miss doubles the gap
    gate.probed(True)
    assert [gate.free_size(0.0, [0.1]) for _ in range(4)] == [0, 0, 0, 1]   # a hit resets it
    assert gate.free_size(0.0, [0.9]) == 1 and gate.free_since == 0         # paying proposals need no probe


def test_cost_model_verify_estimates_stay_consistent_and_recover(eng):
    """Verify costs are kept in decode steps, never above a measured larger pass, and a pessimistic estimate the
    gate stops choosing (so never re-measures) drifts back to the prior: a persisted v(4) of 3.8 steps once kept
    4-token trees off for good."""
    from swiftk.target import costs as C

    c = CostModel(eng.model)
    c.observe_step(0.02)
    c.observe_verify(2, 0.0282)          # noise: 1.41 steps for 2 tokens ...
    c.observe_verify(4, 0.0236)          # ... beside 1.18 for 4
    assert c.v(2) <= c.v(4) == pytest.approx(0.0236)
    assert c.ratio(3) <= c.ratio(4) and c.ratio(2) >= 1.0
    for _ in range(50):                  # the machine gets twice as slow for everything: ratios carry over
        c.observe_step(0.04)
    assert c.v(4) == pytest.approx(0.04 * 1.18, rel=0.02)

    stale = CostModel(eng.model)
    stale.load_dict({"step_s": 0.0225, "verify_s": {"2": 0.0234, "4": 0.0866, "8": 0.0764}})
    assert stale.ratio(4) <= stale.ratio(8)             # v(4) above the larger pass's estimate is not believed
    before = stale.ratio(8)
    for _ in range(4 * C._HALF_LIFE):                   # plain steps only: bucket 8 is never observed again
        stale.observe_step(0.0225)
    assert before > 1.5 and stale.ratio(8) < 1.1 * stale._prior_v(8)   # (another process: a quarter believed)
    assert stale.ratio(2) == pytest.approx(0.0234 / 0.0225, rel=1e-6)  # below the prior: kept as measured


@pytest.mark.parametrize("pairs", [False, True])
def test_odd_passes_are_priced_as_the_pairs_kernel_runs_them(eng, pairs):
    """Where the kernel multiplies activation rows in pairs, a pass of 5 tokens costs what 6 cost: it is priced and
    filed as 6, so it no longer inflates the 4-token bucket; elsewhere every size is its own."""
    c = CostModel(eng.model)
    c.pairs = pairs
    c.observe_step(0.01)
    c.observe_verify(4, 0.012)
    c.observe_verify(5, 0.015)
    assert (c.ratio(4) == pytest.approx(1.2)) if pairs else c.ratio(4) > 1.21   # without pairs, 5 is filed under 4
    assert (6 in c.verify) == pairs and (c.ratio(5) == c.ratio(6)) == pairs
    assert (c.ratio(3) == c.ratio(4)) == pairs
    assert c.ratio(2) < c.ratio(3)
    assert CostModel(eng.model).pairs is False   # the tiny test model's float32 weights never pair rows


@pytest.mark.parametrize("isa,pairs", [(3, True), (2, False), (None, False)])
def test_rows_pair_only_where_the_int8_kernel_runs_pairs(eng, monkeypatch, isa, pairs):
    """CostModel.pairs follows the loaded int8 kernel's path (swk_qi_isa 3: AVX-512 VNNI; None: no kernel library)
    for GGUF blocks with int8 activations."""
    from types import SimpleNamespace
    from swiftk.runtime.ops import cpu_quant

    def need():   # the library cpu_quant binds, or its error where there is none
        if isa is None:
            raise SwiftkError("CPU quant kernel unavailable: test")
        return SimpleNamespace(swk_qi_isa=lambda: isa)

    monkeypatch.setattr(cpu_quant, "_need", need)
    monkeypatch.setattr(eng.model, "weights", "native", raising=False)
    monkeypatch.setattr(eng.model, "activations", "int8", raising=False)
    assert CostModel(eng.model).pairs is pairs
    monkeypatch.setattr(eng.model, "activations", "float32", raising=False)
    assert CostModel(eng.model).pairs is False


def test_the_prior_slope_is_this_machines(eng):
    """A CPU engine prices trees from its own step and 8-token pass, timed at load (a 2-3x pessimistic prior seals
    itself: the gate never tries the sizes it overprices); the timing leaves the cache empty."""
    from swiftk.target.costs import timed_passes

    step, pass8 = timed_passes(eng.model, eng.cache, 8, context=16, reps=1)
    assert 0 < step and 0 < pass8 and eng.cache.length == 0
    c = CostModel(eng.model)
    c.calibrate(0.010, 0.017, 8)
    assert c.slope == pytest.approx(0.1) and c.ratio(8) == pytest.approx(1.7)
    c.calibrate(0.010, 0.009, 8)                # a pass timed faster than a step (noise): the floor
    assert c.slope == pytest.approx(0.01)
    c.calibrate(0.010, 1.0, 8)                  # a hiccup: the ceiling
    assert c.slope == pytest.approx(0.5)
    assert 0.01 <= eng.costs.slope <= 0.5       # the engine's came from its own passes
    assert eng.costs.slope != CostModel(eng.model).slope or eng.costs.slope in (0.01, 0.5)


@pytest.mark.parametrize("method", ["ngram", "swift"])
def test_ngram_proposals_continue_after_the_root(eng, monkeypatch, method):
    """The tree's root is the pending token (sampled, not yet in the cache): an n-gram proposal hangs under it, so
    the index it is looked up in must end with that token. (It once ended one token earlier: every proposal was a
    guess for the root itself, and MT-Bench's extraction prompt, a verbatim copy, accepted nothing.)"""
    from swiftk.proposers.context import ContextNgrams

    seen, orig_propose, orig_build = [], ContextNgrams.match, decode_mod.build_tree

    def propose(self, ctx):
        out = orig_propose(self, ctx)
        seen.append(["index", self.index.tokens[-1]])
        return out

    def build_tree(root, *a, **kw):
        seen[-1].append(root)
        return orig_build(root, *a, **kw)

    monkeypatch.setattr(ContextNgrams, "match", propose)
    monkeypatch.setattr(decode_mod, "build_tree", build_tree)
    ref = ar(eng, n=48)
    out = eng.generate(PROMPT, max_new_tokens=48, method=method, speculate="always", optimize=False)
    assert out.token_ids == ref
    rounds = [r for r in seen if len(r) == 3]
    assert len(rounds) >= 10 and all(last == root for _, last, root in rounds)


def test_context_estimates_are_the_states_and_a_low_one_still_probes(eng, monkeypatch):
    """The context source's estimates, keyed by match length and consistency, belong to the learned state (what a
    long match is worth is the model's and the traffic's, not one text's). A key that earlier prompts drove below
    the gate's floor still proposes its first node, so a probe can find that the text repeats now (an extraction
    question copying from its prompt after chat prompts that never repeat)."""
    from swiftk.proposers import ContextNgrams
    from swiftk.proposers.base import Context

    made, orig = [], ContextNgrams.__init__

    def init(self, estimates=None):
        orig(self, estimates)
        made.append(self)

    monkeypatch.setattr(ContextNgrams, "__init__", init)
    eng.generate(PROMPT, max_new_tokens=32, history=False, datastore=False, speculate="always")
    eng.generate("def f(x):", max_new_tokens=8)
    assert len(made) == 2 and made[0].est is made[1].est is eng.state.estimates["ngram"]
    for key in range(len(made[0].est)):   # every key far below the floor
        for _ in range(60):
            made[0].est.observe(key, False)
    chains = ContextNgrams(made[0].est).propose(Context([5, 6, 7, 8, 5, 6, 7], 4, 0.05))
    assert [c.tokens for c in chains] == [[8]]   # only the probe node


@pytest.mark.parametrize("matchness, drafts", [(None, False), (0.0, False), (1.0, True)])
def test_a_running_search_drafts_only_with_a_set_expected_to_pay(eng, monkeypatch, matchness, drafts):
    """While the search runs, the incumbent's measured matchness decides: no measurement yet or one predicting
    less than plain speed -> no layer drafts; a paying one -> drafts. Output unchanged either way."""
    ref = ar(eng, n=48)
    eng.target.costs = _Costs(eng.model, verify=1.0, draft=0.2)
    eng.reset_optimizer(context_window=120)   # > the tokens generated: no optimization step changes the incumbent
    eng.optimizer.best_matchness = matchness
    calls = []
    real = layerskip_mod.draft
    monkeypatch.setattr(layerskip_mod, "draft", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = eng.generate(PROMPT, max_new_tokens=48, ngram=False)
    assert out.token_ids == ref and not eng.optimizer.done
    assert bool(calls) == drafts, len(calls)


def test_coupled_sampling_is_reproducible_across_methods_and_states(eng):
    kw = dict(max_new_tokens=48, temperature=0.9, top_p=0.95, seed=123)
    a = eng.generate(PROMPT, method="autoregressive", **kw).token_ids
    assert eng.generate(PROMPT, **kw).token_ids == a                     # fresh state
    eng.generate("w9 w8 w7 w6 w5", max_new_tokens=64)                     # the state learns something
    assert eng.generate(PROMPT, **kw).token_ids == a                     # warmed state
    assert eng.generate(PROMPT, method="ngram", **kw).token_ids == a
    assert eng.generate(PROMPT, method="early_exit", exit_layer=2, **kw).token_ids == a
    assert eng.generate(PROMPT, method="autoregressive", **{**kw, "seed": 124}).token_ids != a


def test_two_threads_on_one_engine_serialize(eng):
    prompts = ["w3 w4 w5", "w10 w11 w12 w13", "w20 w21", "w7 w7 w7 w8"]
    want = {p: ar(eng, p, 32) for p in prompts}
    got, errors = {}, []

    def work(p):
        try:
            for _ in range(2):
                got.setdefault(p, []).append(eng.generate(p, max_new_tokens=32).token_ids)
        except BaseException as e:  # surfaced below
            errors.append(e)

    ths = [threading.Thread(target=work, args=(p,)) for p in prompts]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout=300)
    assert not errors and all(not t.is_alive() for t in ths)
    assert all(outs == [want[p]] * 2 for p, outs in got.items())


def test_abandoned_stream_cancels_and_leaves_the_engine_usable(eng):
    it = eng.stream(PROMPT, max_new_tokens=200)
    next(it)
    it.close()  # the consumer walks away
    assert eng.calls.lock.acquire(timeout=60)  # the worker finished (cancelled), the engine is free
    eng.calls.lock.release()
    assert eng.generate(PROMPT, max_new_tokens=16).token_ids == ar(eng, n=16)


def test_persisted_state_round_trip_corrupt_and_foreign(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path))
    e1 = swiftk.load(str(tiny_dir), persist=True)
    e1.generate(PROMPT, max_new_tokens=32)
    path = e1.states.path
    assert path.is_file() and path.parent == tmp_path / "state"
    e1.state.skip_set = e1.states.from_layers(attention=[2], mlp=[3])
    e1.generate(PROMPT, max_new_tokens=8, optimize=False)
    e2 = swiftk.load(str(tiny_dir), persist=True)
    assert torch.equal(e2.skip_set, e1.skip_set) and e2.state.tokens_seen == e1.state.tokens_seen
    assert e2.costs.step == pytest.approx(e1.costs.step)
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the saved decoding state"):
        e3 = swiftk.load(str(tiny_dir), persist=True)
    assert e3.state.tokens_seen == 0
    data = json.loads(json.dumps(e1.state.to_dict({"name": "other-model"})))
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="another model"):
        swiftk.load(str(tiny_dir), persist=True)
    # concurrent writers: every reader sees a whole file
    engines = [swiftk.load(str(tiny_dir), persist=True) for _ in range(2)]
    stop = threading.Event()
    bad = []

    def reader():
        while not stop.is_set():
            try:
                json.loads(path.read_text())
            except FileNotFoundError:
                pass
            except ValueError as e:
                bad.append(e)

    r = threading.Thread(target=reader)
    r.start()
    ws = [threading.Thread(target=lambda e=e: [e.states.save() for _ in range(30)]) for e in engines]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    stop.set()
    r.join()
    assert not bad
    assert swiftk.load(str(tiny_dir), persist=True).state.tokens_seen >= 0
    assert not list((tmp_path / "state").glob("*.tmp"))


@pytest.mark.parametrize("method,kw", [("swift", {}), ("ngram", {}), ("early_exit", {"exit_layer": 2}),
                                       ("static", {"skip_set": {"attention": [2], "mlp": []}})])
def test_one_token_calls_never_enter_the_loop(eng, method, kw):
    """max_new_tokens=1 stops after the prefill: the round loop never runs and the stats must still be whole."""
    out = eng.generate(PROMPT, max_new_tokens=1, method=method, **kw)
    assert out.token_ids == ar(eng, n=1) and out.stats.rounds == 0 and out.finish_reason == "length"


@pytest.mark.parametrize("verify,draft,searches", [(2.0, 1.0, False), (1.0, 0.5, True)])
def test_no_search_where_even_full_acceptance_cannot_pay(eng, verify, draft, searches):
    """A draft step costing a plain step and a verify pass of 2 steps: k drafts always accepted give k + 1 tokens
    for k + 2 steps, slower than plain decoding, so the skip-set search never spends a step; with cheap drafts and
    verify passes it searches as before. The output is the same."""
    ref = ar(eng, n=64)
    eng.target.costs = _Costs(eng.model, verify=verify, draft=draft)
    eng.reset_optimizer(context_window=8, opt_budget=1.0, call_budget=1.0)
    out = eng.generate(PROMPT, max_new_tokens=64, ngram=False, history=False, recycle=False, datastore=False)
    assert out.token_ids == ref
    assert (eng.optimizer.steps > 0) == searches, eng.optimizer.steps


@pytest.mark.parametrize("auto,call_budget,ahead,runs", [
    (True, 0.01, -0.001, False),  # 1 ms behind: 1% of its second, less that, cannot pay a 10 ms pass
    (True, 0.01, 0.001, True),    # it saved 1 ms: with the 1% (10 ms) that pays for it
    (True, 0.01, -0.5, False),    # behind plain decoding already
    (True, 1.0, -0.5, True),      # call_budget=1: the whole call may go to the search
    (False, 0.01, -0.5, True),    # speculate="always": only the lifetime budget counts
])
def test_a_search_step_spends_what_the_call_saved(monkeypatch, auto, call_budget, ahead, runs):
    """speculate='auto': a skip-set search step (a lump of matchness passes) runs only while the call stays
    within ``call_budget`` of plain decoding's time -- it spends what this call's drafts saved (``ahead``) plus
    that share of the call -- so it never makes a call that gained nothing slower (SmolLM2 on CPU blocks: a 22 ms
    step inside a 250 ms call, 0.86x autoregressive)."""
    from types import SimpleNamespace

    from swiftk.decoding.state import LearnedState
    from swiftk.proposers.base import DraftContext

    st = LearnedState(4, OptimizerConfig(context_window=8, opt_budget=1.0, call_budget=call_budget))
    costs = SimpleNamespace(opt=0.01, clock=0, observe_opt=lambda dt: None)
    d = layerskip_mod.LayerSkipDraft(st, costs=costs)
    monkeypatch.setattr(d, "_can_pay", lambda: True)
    ran = []
    monkeypatch.setattr(d, "_search_step", lambda dc, window: ran.append(1) or (0.5, "test", 2))
    dc = DraftContext(None, None, list(range(40)), None, SimpleNamespace(auto=auto), 4, 8, (), False,
                      decoded=30, elapsed=1.0, ahead=ahead)
    phase, found = d.optimize(dc)
    assert bool(ran) == runs and phase == ("optimize" if runs else "context")


@pytest.mark.parametrize("matchness,give_up,stops", [(0.05, 50, True), (0.3, 50, False), (0.05, 1000, False)])
def test_a_hopeless_search_is_given_up_and_its_set_never_drafts(monkeypatch, matchness, give_up, stops):
    """After its first candidates, a speed search whose best set accepts under a quarter of what would pay (0.6
    here) stops, and the drafter no longer drafts with that set (CPU blocks: 0.0-0.09 against 0.74-0.91 in every
    run); a set within reach keeps the search going, and give_up >= max_opt_steps turns the rule off."""
    from types import SimpleNamespace

    from swiftk.decoding.state import LearnedState
    from swiftk.proposers.base import DraftContext

    class Costs:   # a set pays from acceptance 0.6 on
        clock, opt = 0, 0.01

        def observe_opt(self, dt):
            pass

        def kept_fraction(self, mask, head_bytes=None):
            return 0.5

        def break_even(self, kf):
            return 0.6

        def expected_rate(self, m, kf):
            return m / 0.6

    st = LearnedState(4, OptimizerConfig(context_window=8, opt_budget=1.0, call_budget=1.0, give_up=give_up))
    d = layerskip_mod.LayerSkipDraft(st, costs=Costs())
    monkeypatch.setattr(d, "_can_pay", lambda: True)

    passes = []   # every matchness pass scores a set at this acceptance
    monkeypatch.setattr(layerskip_mod, "matchness", lambda *a, **k: passes.append(a[4].clone()) or matchness)
    gate = SimpleNamespace(auto=True, should_draft=lambda: True)
    model = SimpleNamespace(device=torch.device("cpu"))   # no weights: a draft step would fail
    dc = DraftContext(model, None, list(range(40)), None, gate, 4, 8, (), False, decoded=30, elapsed=1.0, ahead=1.0)
    assert not d.resting(gate, model.device)
    start = st.optimizer.best.clone()
    assert d.optimize(dc)[0] == "optimize"
    # the first step scores the starting set alone: one pass, where a hopeless search ends
    assert len(passes) == 1 and torch.equal(passes[0], start) and st.optimizer.steps == 1
    assert st.optimizer.done == stops
    if stops:   # the drafter leaves the round before a draft step; the loop skips it altogether
        assert d.propose(dc) == [] and d.optimize(dc) == ("accelerate", None)
        assert d.resting(gate, model.device)
    else:   # later steps score candidates against it
        d.optimize(dc)
        assert len(passes) == 2 and st.optimizer.steps == 2


def test_search_budget_follows_what_it_has_found():
    """Half the budget for the first candidates, the full budget once a set is expected to pay; after the first
    candidates found none, half of it scaled by the square of how close the best set's acceptance came to the one
    that would pay, never below a fiftieth; the paper's matchness objective always gets the full budget."""
    from swiftk.decoding.state import LearnedState

    class Costs:   # a set needs acceptance 0.6 to pay
        clock = 0

        def kept_fraction(self, mask, head_bytes=None):
            return 0.5

        def break_even(self, kf):
            return 0.6

    def budget(state):
        return layerskip_mod.LayerSkipDraft(state, costs=Costs())._budget()

    st = LearnedState(4)
    b, o = st.cfg.opt_budget, st.optimizer
    assert budget(st) == b / 2
    o.best_score = 1.2
    assert budget(st) == b
    o.best_score, o.steps = 0.7, layerskip_mod._EXPLORE
    o.best_matchness = 0.3
    assert budget(st) == pytest.approx(b / 8)
    o.best_matchness = 0.0
    assert budget(st) == pytest.approx(b / 50)
    o.best_matchness = 0.9   # scored below plain on its windows after all: no more than the exploring budget
    assert budget(st) == pytest.approx(b / 2)
    assert budget(LearnedState(4, type(st.cfg)(objective="matchness"))) == b


def test_break_even_acceptance_is_where_drafting_matches_plain(eng):
    c = _Costs(eng.model, verify=1.5, draft=0.25)
    c.observe_step(0.01)
    m = c.break_even(0.5)
    assert 0.0 < m < 1.0
    assert c.expected_rate(m, 0.5) >= 1.0 > c.expected_rate(m - 1e-3, 0.5)
    assert _Costs(eng.model, verify=2.0, draft=1.0).break_even(0.5) > 1.0   # k + 1 tokens for k + 2 steps


def test_free_chains_are_cut_where_they_stop_paying_but_keep_a_first_token():
    """A chain is built only as deep as its cumulative estimate stays above the gate's floor, but never to nothing:
    the probes that let a low estimate notice text that started repeating verify a declined chain's first token."""
    from swiftk.proposers.datastore import Datastore
    from swiftk.proposers import useful

    assert useful(0.8, 25, 0.035) == 15 and 0.8 ** 15 >= 0.035 > 0.8 ** 16
    assert useful(0.01, 25, 0.035) == 1 and useful(0.0, 25, 0.035) == 1
    assert useful(0.3, 25, 0.0) == 25 and useful(0.9, 0, 0.035) == 0
    ds = Datastore.build([1, 2, 3, 4, 5, 6] * 4)
    assert ds.propose([1], 5)[0] == [2, 3, 4, 5, 6]
    assert ds.propose([1], 5, prob=lambda b: 0.5, floor=0.2)[0] == [2, 3]       # 0.5, 0.25 | 0.125
    assert ds.propose([1], 5, prob=lambda b: 0.01, floor=0.2)[0] == [2]         # below the floor: the first only


@pytest.mark.parametrize("method", ["autoregressive", "swift"])
def test_stats_report_the_prefill_apart(eng, monkeypatch, method):
    real = eng.model.forward

    def slow_prefill(*a, **kw):   # the prompt's pass (the one pass that asks for its last row's logits) lasts >= 50 ms
        if kw.get("logits_idx") is not None:
            time.sleep(0.05)
        return real(*a, **kw)

    monkeypatch.setattr(eng.model, "forward", slow_prefill)
    st = eng.generate(PROMPT, max_new_tokens=8, method=method).stats
    assert st.time_prefill_s >= 0.05
    if method == "swift":   # the phases partition the call: the prefill is not also counted as verify time
        parts = st.time_prefill_s + st.time_verify_s + st.time_draft_s + st.time_other_s + st.time_optimize_s
        assert parts <= st.wall_time_s and st.time_verify_s < st.wall_time_s - 0.05


# ---- the free sources' host time (SourceBudget) ---------------------------------------------------------------------
def _consults(budget, rounds: int, spent: dict, accepted: dict, step_s: float = 0.005) -> dict:
    """Drive a SourceBudget for ``rounds`` rounds in which each consulted source spends ``spent[name]`` seconds and
    gets ``accepted[name]`` tokens accepted; returns how many rounds consulted each."""
    n = {k: 0 for k in spent}
    for _ in range(rounds):
        budget.start_round()
        for k in budget.on:
            n[k] += 1
            budget.spent[k] = spent[k]
        budget.end_round({k: accepted[k] for k in budget.on}, step_s)
    return n


def test_a_source_whose_host_time_buys_nothing_is_only_probed():
    from swiftk.decoding.budget import SourceBudget

    spent = {"slow": 0.001, "useful": 0.001, "cheap": 0.0, "small": 0.00002}
    accepted = {"slow": 0, "useful": 1, "cheap": 0, "small": 0}
    n = _consults(SourceBudget(spent), 200, spent, accepted)   # a step of 5 ms
    assert n["useful"] == 200 and n["cheap"] == 200   # pays for itself / costs nothing: every round
    assert n["small"] == 200                          # 0.4% of a step: below the share, never skipped
    assert 8 <= n["slow"] <= 8 + 200 // 16 + 5, n      # 20% of a step: its first rounds, then every 16th at most
    mid = _consults(SourceBudget(["m"]), 200, {"m": 0.0001}, {"m": 0})   # 2% of a step: every 4th round
    assert 8 + 192 // 4 <= mid["m"] <= 8 + 192 // 4 + 5, mid
    # "always": every source every round, whatever it costs
    assert _consults(SourceBudget(spent, auto=False), 50, spent, accepted)["slow"] == 50
    # a source that starts paying is consulted every round again
    b = SourceBudget(["s"])
    _consults(b, 100, {"s": 0.001}, {"s": 0})
    late = _consults(b, 100, {"s": 0.001}, {"s": 2})
    assert late["s"] >= 80, late


def test_a_slow_useless_proposer_is_rarely_asked_and_output_is_unchanged(eng):
    ref = ar(eng, n=160)

    class Slow:
        calls = 0

        def propose(self, tokens):
            Slow.calls += 1
            time.sleep(0.002)   # far more than a round of the tiny model gains from it: nothing
            return [int(tokens[-1]) ^ 1]   # never what the model says next (greedy on this prompt)

    out = eng.generate(PROMPT, max_new_tokens=160, proposers=[Slow()], optimize=False)
    assert out.token_ids == ref
    passes = out.stats.rounds + out.stats.plain_steps
    assert passes >= 20 and Slow.calls <= 8 + passes // 4, (Slow.calls, passes)   # without the budget: every pass


def test_a_call_is_ahead_by_what_its_rounds_produced_less_all_their_time(eng):
    """What a search step may spend (DraftContext.ahead): per closed round, what it produced at a plain step per
    token -- a plain round's own timed step, so a step estimate far off (here 1 s against milliseconds) moves
    nothing -- less everything the round took: its host work (10 ms a round here) and a search step."""
    from swiftk.decoding.gate import Gate
    from swiftk.decoding.output import TokenSink
    from swiftk.sample.sampler import Sampler, SamplingParams
    from swiftk.decoding.session import Session

    class Stale(CostModel):
        def observe_step(self, dt):
            self.step = 1.0

    cfg = DecodeConfig().validate()
    costs = Stale(eng.model)
    costs.step = 1.0
    s = Session(eng.model, eng.cache, costs, Gate(costs, eng.new_state().gate, cfg), Sampler(SamplingParams(), "cpu"),
                TokenSink(eng.tokenizer, 64), cfg, eng.encode_prompt(PROMPT))
    d = Decoder(s, None, [])

    def round_():   # plan (opens the round's account), its pass alone, finish
        p = d.plan()
        if p.kind != "prefill":
            time.sleep(0.01)         # a round's host work: sources, tree, bookkeeping
        t = time.perf_counter()
        d.finish(p, d.run(p), time.perf_counter() - t)
        return p.kind

    assert round_() == "prefill"
    assert [round_() for _ in range(20)] == ["plain"] * 20
    s.begin_round()                  # closes the last round's account
    behind = s.draft_context().ahead
    assert s.draft_context().decoded == 21 and behind <= -0.20
    time.sleep(0.05)                 # a search step inside the open round
    s.searched(s.begin_round() - 0.05, None)
    s.begin_round()
    assert s.draft_context().ahead <= behind - 0.05


def test_the_reference_method_reads_and_writes_nothing_learned(eng):
    """The reference runs the round every method runs (a plain step a round, through the scheduler) but leaves the
    engine's learned state and its cost model as they were, so an AR arm beside a speculative one changes nothing."""
    before, seen = eng.costs.to_dict(), eng.state.tokens_seen
    out = eng.generate(PROMPT, max_new_tokens=12, method="autoregressive")
    assert out.stats.plain_steps >= 11 and out.stats.method == "autoregressive"
    assert eng.costs.to_dict() == before and eng.state.tokens_seen == seen


def test_decode_checks_its_arguments(eng):
    req = eng.calls.request(PROMPT, max_new_tokens=4)
    with pytest.raises(SwiftkError, match="max_batch"):
        eng.calls.decode([req], 0)   # no slot: the scheduler would never admit it
    with pytest.raises(SwiftkError, match="Requests"):
        eng.calls.decode([PROMPT], 1)
    assert eng.calls.decode([req], 1)[0].token_ids == eng.generate(PROMPT, max_new_tokens=4).token_ids
