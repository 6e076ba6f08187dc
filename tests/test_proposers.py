"""Pluggable draft sources: user proposers through generate(proposers=[...]) are priced, gated and lossless; the
learned state round-trips completely and carries only what belongs across prompts; the reference method
(autoregressive) reads and writes no learned state."""
import json
import random

import pytest
import torch

import swiftk
from swiftk import methods
from swiftk.errors import SwiftkError
from swiftk.target.costs import CostModel
from swiftk.decoding.state import LearnedState

PROMPT = "w3 w4 w5 w6 w7 w3 w4 w5"
N = 96


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def eng(tiny_dir):
    return swiftk.load(str(tiny_dir), persist=False)


class Oracle:
    """Proposes the known greedy continuation of ``full`` (prompt + reference output) while the sequence follows
    it; nothing once it does not."""

    def __init__(self, full, k=16):
        self.full, self.k, self.calls = full, k, 0

    def propose(self, tokens):
        self.calls += 1
        n = len(tokens)
        return self.full[n:n + self.k] if tokens == self.full[:n] else []


class RandomTokens:
    name = "random"

    def __init__(self, vocab, seed=0):
        self.rng, self.vocab = random.Random(seed), vocab

    def propose(self, tokens):
        return [self.rng.randrange(self.vocab) for _ in range(8)]


class PinnedCosts(CostModel):
    """The costs of a real model (a 10 ms step, each extra verified token 0.05 of one), never re-timed: on the tiny
    test model a step is ~0.1 ms of host work, a 2-token pass measured 1.6-3.6 steps, and how much the gate
    drafted swung with the machine's load."""

    def __init__(self, model):
        super().__init__(model)
        self.step, self.slope = 0.01, 0.05

    def observe_step(self, dt):
        self._clock += 1

    def observe_verify(self, T, dt):
        self._clock += 1

    def observe_draft(self, kf, dt):
        pass


def _free_off():
    return dict(ngram=False, history=False, datastore=False, recycle=False)


def test_an_oracle_proposer_is_accepted_and_output_is_unchanged(eng):
    ref = eng.generate(PROMPT, max_new_tokens=N, method="autoregressive")
    eng.target.costs = PinnedCosts(eng.model)
    oracle = Oracle(ref.prompt_ids + ref.token_ids)
    for method in ("ngram", "swift"):
        out = eng.generate(PROMPT, max_new_tokens=N, method=method, proposers=[oracle], **_free_off())
        assert out.token_ids == ref.token_ids, method
        s = out.stats
        assert s.accepted_by_source["Oracle"] >= N - s.rounds - s.plain_steps - 1   # nearly every token is its
        assert s.mean_accepted_length >= 4, (method, s.mean_accepted_length, s.accept_lengths)
    assert oracle.calls > 0


def test_a_random_proposer_is_learned_to_be_useless_and_changes_nothing(eng):
    ref = eng.generate(PROMPT, max_new_tokens=N, method="autoregressive").token_ids
    out = eng.generate(PROMPT, max_new_tokens=N, method="ngram", proposers=[RandomTokens(eng.config.vocab_size)],
                       **_free_off())
    assert out.token_ids == ref
    s = out.stats
    # after a few misses its estimate falls below what a verify pass costs: plain steps, and rare probes
    assert s.plain_steps >= 0.7 * N and s.rounds <= 0.25 * N, (s.plain_steps, s.rounds)
    assert s.drafted_tokens <= 3 * s.rounds


def test_proposers_keep_seeded_sampling_exact(eng):
    kw = dict(max_new_tokens=48, temperature=0.9, top_p=0.95, seed=7)
    ref = eng.generate(PROMPT, method="autoregressive", **kw)
    full = ref.prompt_ids + ref.token_ids
    out = eng.generate(PROMPT, method="swift", proposers=[Oracle(full), RandomTokens(eng.config.vocab_size)], **kw)
    assert out.token_ids == ref.token_ids and out.stats.accepted_by_source["Oracle"] > 0
    # two sources of one name (or a built-in's) each keep their own estimates and counts
    ngram = RandomTokens(eng.config.vocab_size)
    ngram.name = "ngram"
    out = eng.generate(PROMPT, proposers=[Oracle(full), Oracle(full), ngram], **kw)
    assert out.token_ids == ref.token_ids
    assert {"Oracle", "Oracle#2", "ngram#2"} <= set(out.stats.accepted_by_source)


def test_bad_proposers_are_rejected_by_name_and_leave_the_engine_usable(eng):
    ref = eng.generate(PROMPT, max_new_tokens=16, method="autoregressive").token_ids

    class Raises:
        def propose(self, tokens):
            raise RuntimeError("boom")

    class Returns:
        def __init__(self, value):
            self.value = value

        def propose(self, tokens):
            return self.value

    with pytest.raises(SwiftkError, match="propose"):
        eng.generate(PROMPT, max_new_tokens=8, proposers=[object()])
    with pytest.raises(SwiftkError, match="list of objects"):
        eng.generate(PROMPT, max_new_tokens=8, proposers=Oracle([]))
    with pytest.raises(SwiftkError, match="Raises.*boom"):
        eng.generate(PROMPT, max_new_tokens=16, proposers=[Raises()])
    for bad in ([eng.config.vocab_size], [-1], ["a"], [1.5], [True], 7):
        with pytest.raises(SwiftkError, match="Returns"):
            eng.generate(PROMPT, max_new_tokens=16, proposers=[Returns(bad)])
    with pytest.raises(SwiftkError, match="no proposers"):
        eng.generate(PROMPT, max_new_tokens=8, method="autoregressive", proposers=[Oracle([])])
    with pytest.raises(SwiftkError, match="rejection"):
        eng.generate(PROMPT, max_new_tokens=8, temperature=0.8, sampling="rejection", proposers=[Oracle([])])
    assert eng.generate(PROMPT, max_new_tokens=16, proposers=[Returns([]), Returns(None)]).token_ids == ref


def test_autoregressive_reads_and_writes_no_learned_state(eng):
    before = json.dumps(eng.state.to_dict(eng.identity), sort_keys=True)
    ar = eng.generate(PROMPT, max_new_tokens=48, method="autoregressive")
    assert json.dumps(eng.state.to_dict(eng.identity), sort_keys=True) == before
    assert len(eng.state.history) == 0 and eng.state.tokens_seen == 0
    # so an A/B on one engine measures speculation, not a replay of the reference's output
    out = eng.generate(PROMPT, max_new_tokens=48)
    assert out.token_ids == ar.token_ids and out.stats.accepted_by_source["history"] == 0
    assert len(eng.state.history) > 0 and eng.state.tokens_seen == 48


def test_learned_state_round_trips_completely_and_carries_only_what_outlives_a_prompt(eng, tiny_dir, tmp_path,
                                                                                      monkeypatch):
    from swiftk.proposers.datastore import Datastore

    ref = eng.generate(PROMPT, max_new_tokens=48, method="autoregressive")
    eng.use_corpus(Datastore.build((ref.prompt_ids + ref.token_ids) * 2))
    for _ in range(3):   # history and corpus estimates learn; so do the calibration, the gate and the search
        # (a fixed tree budget: the one from the cost model follows this machine's timing of the tiny model)
        eng.generate(PROMPT, max_new_tokens=48, speculate="always", max_tree_nodes=16)
    d = eng.state.to_dict(eng.identity)
    assert set(d["estimates"]) == {"ngram", "history", "recycle", "datastore"}
    prior = {n: cls.new_estimates().to_dict() for n, cls in (("history", swiftk.proposers.SessionHistory),
                            ("datastore", swiftk.proposers.CorpusNgrams), ("ngram", swiftk.proposers.ContextNgrams))}
    assert all({k: d["estimates"][n][k] for k in ("hits", "tries")} != prior[n] for n in prior)   # they learned
    back = LearnedState.from_dict(json.loads(json.dumps(d)), eng.identity, eng.config.n_layers)
    assert back.to_dict(eng.identity) == d
    assert len(back.history) == 0   # user outputs stay in memory
    # through the engine's file: a new process starts from every learned estimate
    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path))
    e1 = swiftk.load(str(tiny_dir), persist=True)
    e1.use_corpus(Datastore.build((ref.prompt_ids + ref.token_ids) * 2))
    for _ in range(2):
        e1.generate(PROMPT, max_new_tokens=48, speculate="always")
    e2 = swiftk.load(str(tiny_dir), persist=True)
    assert e2.state.to_dict(e2.identity) == e1.state.to_dict(e1.identity)
    # damaged values are refused with the file named, and the engine starts fresh
    bad = json.loads(e1.states.path.read_text())
    bad["estimates"]["history"]["hits"][0] = float("nan")
    e1.states.path.write_text(json.dumps(bad))
    with pytest.warns(UserWarning, match="corrupt"):
        e3 = swiftk.load(str(tiny_dir), persist=True)
    assert e3.state.tokens_seen == 0


def test_methods_are_objects_that_check_their_own_arguments(eng):
    assert set(methods.names()) >= {"swift", "autoregressive", "early_exit", "static", "ngram", "moa"}
    with pytest.raises(SwiftkError, match="unknown method"):
        eng.generate(PROMPT, max_new_tokens=4, method="nope")
    with pytest.raises(SwiftkError, match="exit_layer"):
        eng.generate(PROMPT, max_new_tokens=4, method="early_exit")
    with pytest.raises(SwiftkError, match="skip_set"):
        eng.generate(PROMPT, max_new_tokens=4, method="ngram", skip_set={"attention": [1], "mlp": []})
    with pytest.raises(SwiftkError, match="layer"):
        eng.generate(PROMPT, max_new_tokens=4, state=LearnedState(eng.config.n_layers + 1))


def test_the_skip_set_search_and_layer_drafts_run_with_a_reduced_draft_head(eng, tmp_path, monkeypatch):
    """The draft head (a vocabulary subset) is used by both the draft steps and the search's matchness passes."""
    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path))
    import swiftk.proposers.draft_loop as drafter_mod

    heads = []
    real = drafter_mod.matchness
    monkeypatch.setattr(swiftk.proposers.layerskip.draft, "matchness",
                        lambda *a, **k: heads.append(a[-1]) or real(*a, **k))
    eng.reset_optimizer(context_window=4, opt_budget=1.0, call_budget=1.0, bo_mode="sync", max_matchness=1.0)
    ref = eng.generate(PROMPT, max_new_tokens=48, method="autoregressive").token_ids
    out = eng.generate(PROMPT, max_new_tokens=48, draft_vocab=8, speculate="always", ngram=False)
    assert out.token_ids == ref and out.stats.optimization_steps > 0 and out.stats.drafted_tokens > 0
    assert heads and all(h is not None and hasattr(h, "logits_full") for h in heads)


def test_calls_from_inside_a_callback_and_out_of_range_inputs_are_refused(eng, tiny_dir, tmp_path, monkeypatch):
    """A callback calling back into its own engine would reset the KV cache under the outer call; a temperature
    whose logits / t overflows, a chat flag that is a string, token ids out of the vocabulary, persisted timings
    no pass can take: each is a clear SwiftkError (or a state file ignored with a warning), never wrong output."""
    ref = eng.generate(PROMPT, max_new_tokens=24, method="autoregressive").token_ids
    errors = []

    def nested(piece):
        for call in (lambda: eng.logits([3, 4]), lambda: eng.generate("w1", max_new_tokens=2)):
            try:
                call()
            except SwiftkError as e:
                errors.append(str(e))

    out = eng.generate(PROMPT, max_new_tokens=24, callback=nested)
    assert out.token_ids == ref and errors and all("callback" in e for e in errors)
    assert eng.generate(PROMPT, max_new_tokens=24).token_ids == ref          # and the engine is fine after
    with pytest.raises(SwiftkError, match="temperature"):
        eng.generate(PROMPT, max_new_tokens=4, temperature=1e-40)
    with pytest.raises(SwiftkError, match="chat"):
        eng.generate(PROMPT, max_new_tokens=4, chat="false")
    for bad in ([-1], [eng.config.vocab_size], [True]):
        with pytest.raises(SwiftkError, match="token id"):
            eng.logits(bad)
    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path))
    e1 = swiftk.load(str(tiny_dir), persist=True)
    for key, value in (("step_s", 1e-300), ("opt_step_s", float("nan"))):
        e1.generate(PROMPT, max_new_tokens=8)   # a good file, then one damaged value
        d = json.loads(e1.states.path.read_text())
        d["costs"][key] = value
        e1.states.path.write_text(json.dumps(d))
        with pytest.warns(UserWarning, match=key):
            e2 = swiftk.load(str(tiny_dir), persist=True)
        assert e2.costs.step is None and e2.state.tokens_seen == 0
