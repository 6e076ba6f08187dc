"""swiftk.integrations.vllm and .batch without vLLM: the proposer driven with vLLM's call shape (lists of sampled ids, numpy
token buffers of max_num_seqs rows) by a simulated verifier, its options and startup errors; and the Hugging Face
export that vLLM loads. The real vLLM runs are tests/test_vllm_engine.py."""
from types import SimpleNamespace

import numpy as np
import pytest

from swiftk.errors import SwiftkError
from swiftk.proposers.base import Chain
from swiftk.integrations import batch as sb
from swiftk.integrations import vllm as sv

V, LEN, ROWS = 1000, 4096, 8


def _text(seed: int, n: int, period: int = 23) -> list:
    """A 'model' that repeats a phrase with some noise: what greedy decoding of code or an edit looks like."""
    rng = np.random.default_rng(seed)
    phrase = rng.integers(3, V, period).tolist()
    out = []
    while len(out) < n:
        out.extend(phrase)
        out.append(int(rng.integers(3, V)))
    return out[:n]


class Batch:
    """vLLM's side of the hook: rows of token ids, their lengths, the verify rule (greedy: the longest prefix of
    the draft that matches the target, then the target's next token)."""

    def __init__(self):
        self.ids = np.zeros((ROWS, LEN), dtype=np.int32)
        self.n = np.zeros(ROWS, dtype=np.int32)
        self.reqs = []   # per row: (target sequence, prompt length)

    def add(self, target: list, prompt: int) -> None:
        i = len(self.reqs)
        self.reqs.append([target, prompt])
        self.ids[i, :prompt + 1] = target[:prompt + 1]   # the prefill sampled one token
        self.n[i] = prompt + 1

    def remove(self, i: int) -> None:
        """A request finished: vLLM moves the last row into its place."""
        last = len(self.reqs) - 1
        if i != last:
            self.ids[i], self.n[i], self.reqs[i] = self.ids[last], self.n[last], self.reqs[last]
        self.reqs.pop()
        self.n[last] = 0

    def run(self, drafter, steps: int, sampled=None) -> tuple:
        """``steps`` steps; returns (draft tokens proposed, accepted)."""
        sampled = sampled or [[int(self.ids[i, self.n[i] - 1])] for i in range(len(self.reqs))]
        proposed = accepted = 0
        for _ in range(steps):
            drafts = drafter.step(sampled, self.n, self.ids)
            assert len(drafts) == len(self.reqs)
            sampled = []
            for i, d in enumerate(drafts):
                assert isinstance(d, list) and len(d) <= drafter.k and all(isinstance(t, int) for t in d)
                target, n = self.reqs[i][0], int(self.n[i])
                a = 0
                while a < len(d) and n + a < len(target) and d[a] == target[n + a]:
                    a += 1
                new = target[n:n + a + 1]
                self.ids[i, n:n + len(new)] = new
                self.n[i] = n + len(new)
                sampled.append(new)
                proposed += len(d)
                accepted += a
        return proposed, accepted


def _drafter(k=8, **opts) -> sb.Drafter:
    # a fixed floor: the measured one ("auto") would fit this simulation's microsecond step times, which vary
    # with the machine's load (CI once measured a floor that turned drafts into probes); it has its own test
    opts.setdefault("floor", sb.PRIOR_FLOOR)
    return sb.Drafter(k, V, LEN, sv.parse_options(opts), corpus=None)


def test_repetitive_text_is_drafted_and_accepted():
    d, b = _drafter(sources=["ngram"]), Batch()
    for r in range(3):
        b.add(_text(r, 600), prompt=60)
    proposed, accepted = b.run(d, 120)
    assert accepted > 0.5 * proposed and accepted > 200
    assert all(int(b.n[i]) > 300 for i in range(3))   # ~3+ tokens per step, not 1
    assert d.stats["rebuilt"] == 3 and d.stats["moved"] == 0


def test_low_repetition_text_sends_only_probes():
    rng = np.random.default_rng(7)
    d, b = _drafter(), Batch()
    b.add(rng.integers(3, V, 900).tolist(), prompt=50)
    proposed, accepted = b.run(d, 300)
    assert proposed <= 40, proposed   # random text: no drafts but rare probes of one token


def test_state_follows_a_moved_row_and_is_freed_when_its_request_ends():
    d, b = _drafter(sources=["ngram", "history"]), Batch()
    for r in range(3):
        b.add(_text(r, 800), prompt=40)
    b.run(d, 20)
    kept = d.rows[2]
    b.remove(0)   # row 2 moves to row 0
    b.run(d, 5)
    assert d.rows[0] is kept and d.stats["moved"] == 1 and d.stats["rebuilt"] == 3
    assert len(d.rows) == 2 and d.history.outputs == 1   # the finished request's output joined the history


def test_history_drafts_a_new_request_from_an_earlier_output():
    d, b = _drafter(sources=["history"]), Batch()
    text = _text(11, 400, period=97)
    b.add(text, prompt=10)
    b.run(d, 100)
    b.remove(0)
    b.add(text, prompt=10)   # the same answer again, after a new prompt of 10 tokens
    b.add(_text(12, 400), prompt=10)
    b.run(d, 1)
    assert d.history.outputs == 1
    proposed, accepted = b.run(d, 20)
    assert accepted > 20


def test_memory_is_bounded_per_request():
    d, b = _drafter(sources=["ngram"], context_tokens=256), Batch()
    b.add(_text(3, 3000), prompt=500)
    b.run(d, 300)
    req = d.rows[0]
    assert len(req.tokens) <= 256 and 0 < int(b.n[0]) - req.length() <= d.k + 1   # the last step's tokens
    assert req.srcs[0].index.n_states <= 2 * 256 + 1 and req.offset > 1000


def test_drafts_stop_at_the_model_length():
    d = sb.Drafter(8, V, 50, sv.parse_options({"sources": ["ngram"]}))
    b = Batch()
    b.add([5, 6, 7] * 40, prompt=44)
    drafts = d.step([[int(b.ids[0, 44])]], b.n, b.ids)
    assert len(drafts[0]) <= 50 - 45 - 1


def test_empty_sampled_rows_are_partial_prefills():
    d, b = _drafter(), Batch()
    b.add(_text(0, 300), prompt=100)
    assert d.step([[]], b.n, b.ids) == [[]]


def test_options_are_applied_or_rejected():
    assert sv.parse_options({"floor": 0.3})["floor"] == 0.3
    assert sv.parse_options(None, '{"sources": ["ngram"]}')["sources"] == ["ngram"]
    for bad, match in (({"flor": 0.1}, "unknown option 'flor'"), ({"floor": 1.5}, "floor"),
                       ({"sources": ["suffix"]}, "sources"), ({"proposers": "x:y"}, "proposers"),
                       ({"context_tokens": 128}, "context_tokens"), ({"probe_gap": True}, "probe_gap")):
        with pytest.raises(SwiftkError, match=match):
            sv.parse_options(bad)
    with pytest.raises(SwiftkError, match="not valid JSON"):
        sv.parse_options(None, "{sources")
    # an option is applied: a floor of 0.99 declines what 0.0 sends
    for floor, most in ((0.0, None), (0.99, 0)):
        d, b = _drafter(sources=["ngram"], floor=floor), Batch()
        b.add(_text(5, 400), prompt=100)
        drafts = d.step([[int(b.ids[0, 100])]], b.n, b.ids)
        assert (len(drafts[0]) > 1) if most is None else len(drafts[0]) <= 1


# ---- the vLLM-facing class: startup errors -----------------------------------------------------------------------
def _config(k=8, vocab=V, model="/nonexistent"):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(get_vocab_size=lambda: vocab, max_model_len=LEN, model=model,
                                                        tokenizer=model))


class Echo:
    """A user proposer: proposes the sequence's last 3 tokens again."""

    def propose(self, tokens):
        return list(tokens[-3:])


class Raises:
    def propose(self, tokens):
        raise RuntimeError("boom")


class RaisesLater:
    calls = 0

    def propose(self, tokens):
        RaisesLater.calls += 1
        if RaisesLater.calls > 2:
            raise RuntimeError("late boom")
        return [1]


def test_bad_configuration_is_a_clear_error_at_startup(monkeypatch):
    monkeypatch.setenv(sv.ENV, '{"sources": ["ngram"]}')
    for k in (0, 65, True):
        with pytest.raises(SwiftkError, match="num_speculative_tokens"):
            sv.SwiftkProposer(_config(k=k))
    for path, match in (("no_such_module_xyz:P", "cannot import"), ("test_vllm_proposer:Nope", "no attribute"),
                        ("test_vllm_proposer", "module:attribute"), ("test_vllm_proposer:Raises", "raised"),
                        ("test_vllm_proposer:V", "raised TypeError")):
        monkeypatch.setenv(sv.ENV, '{"sources": ["ngram"], "proposers": ["%s"]}' % path)
        with pytest.raises(SwiftkError, match=match):
            sv.SwiftkProposer(_config())


def test_user_proposers_draft_and_one_that_raises_later_is_switched_off(monkeypatch, caplog):
    monkeypatch.setenv(sv.ENV, '{"sources": [], "proposers": ["test_vllm_proposer:Echo", '
                               '"test_vllm_proposer:RaisesLater", "test_vllm_proposer:Echo"]}')
    p = sv.SwiftkProposer(_config())
    assert [n for n, _ in p.drafter.user] == ["Echo", "RaisesLater", "Echo#2"]
    p.load_model(object())
    b = Batch()
    b.add([4, 5, 6] * 100, prompt=30)
    proposed, accepted = b.run(p.drafter, 30)
    assert accepted > 0 and "RaisesLater" in p.drafter.disabled
    assert "late boom" in caplog.text
    assert p in sv.SwiftkProposer.instances


def test_propose_has_vllms_signature():
    p = sv.SwiftkProposer(_config())
    b = Batch()
    b.add(_text(1, 500), prompt=200)
    out = p.propose([[int(b.ids[0, 200])]], b.n, b.ids, slot_mappings=None)
    assert isinstance(out, list) and len(out) == 1 and isinstance(out[0], list)


# ---- the Hugging Face export vLLM reads ---------------------------------------------------------------------------
def test_export_hf_is_the_same_model(smollm2_path, tmp_path):
    import torch

    import swiftk
    from swiftk.integrations.hf_export import export_hf

    out = export_hf(smollm2_path, tmp_path / "smol")
    a, b = swiftk.load(str(out)), swiftk.load(str(smollm2_path), weights="float32")
    ids = b.tokenizer.encode("def add(a, b):\n    return a + b\n")
    assert a.tokenizer.encode("def add(a, b):\n    return a + b\n") == ids
    assert a.tokenizer.fingerprint() == b.tokenizer.fingerprint()
    assert a.tokenizer.chat_template == b.tokenizer.chat_template and a.tokenizer.eos_ids == b.tokenizer.eos_ids
    assert torch.equal(a.logits(ids), b.logits(ids))
    with pytest.raises(SwiftkError, match="exists"):
        export_hf(smollm2_path, out)
    with pytest.raises(SwiftkError, match="dtype"):
        export_hf(smollm2_path, tmp_path / "x", dtype="int4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol"]   # nothing half-written left behind


def test_the_floor_is_measured_from_step_times():
    c = sb.StepCosts()
    assert c.floor() == sb.PRIOR_FLOOR   # nothing timed yet
    rng = np.random.default_rng(0)
    for _ in range(200):
        T = int(rng.integers(8, 72))
        c.observe(T, 16, 0.030 + 0.002 * T)
    a, b = c.fit()
    assert abs(a - 0.030) < 1e-6 and abs(b - 0.002) < 1e-8
    step = c.y / c.w
    assert abs(c.floor() - 0.002 * 16 / step) < 1e-6
    flat = sb.StepCosts()
    for _ in range(50):
        flat.observe(9, 2, 0.03)   # no spread in T: nothing to fit, the prior stands
    assert flat.floor() == sb.PRIOR_FLOOR
    d = _drafter(floor=0.25)
    assert d.floor() == 0.25
    auto = sb.Drafter(8, V, LEN, sv.parse_options({}), corpus=None)   # the default: the measured floor
    assert auto.opts["floor"] == "auto" and auto.floor() == sb.PRIOR_FLOOR
    auto.costs = c
    assert auto.floor() == c.floor() != sb.PRIOR_FLOOR


def test_the_floor_is_priced_for_the_batch_at_hand():
    # steps of 8 rows and of 1 (a batch draining): each row sends 3 tokens and emits 2; a step costs 30 ms plus
    # 2 ms a token. One more token costs 2 ms against a step's 2 tokens a row: at 1 row 2 * 2 / (30 + 2 * 3) ms,
    # at 8 rows 2 * 16 / (30 + 2 * 24).
    c = sb.StepCosts()
    for i in range(200):
        rows = 8 if i % 3 else 1
        c.observe(3 * rows, 2 * rows, 0.030 + 0.002 * 3 * rows, rows)
    assert abs(c.floor(1) - 0.002 * 2 / 0.036) < 1e-6
    assert abs(c.floor(8) - 0.002 * 16 / 0.078) < 1e-6
    assert c.floor(1) < c.floor() < c.floor(8)
    # the drafter prices each step for its rows: a chain whose first token is reached with a chance between the
    # two floors is sent to a lone request and declined (probed now and then) in a full batch
    d = sb.Drafter(8, V, LEN, sv.parse_options({"sources": ["ngram"]}), corpus=None)
    d.costs = c
    for rows in (1, 8):
        f = d.floor(rows)
        assert f == c.floor(rows)
    mid = (c.floor(1) + c.floor(8)) / 2

    class Fixed:   # a source whose guess is reached with chance `mid`
        name, learns = "fixed", False

        def propose(self, ctx):
            return Chain([7, 8], [mid, 0.99], "fixed", [None, None])

    def sent(rows):
        d.rows = {}
        b = Batch()
        for r in range(rows):
            b.add(_text(r, 300), prompt=100)
        for r in range(rows):
            d.rows[r] = sb._Row(b.ids[r, :101].tolist(), 1, d)
            d.rows[r].srcs = [Fixed()]
        return d.step([[int(b.ids[r, 100])] for r in range(rows)], b.n, b.ids)

    assert sent(1) == [[7, 8]]
    assert all(len(x) <= 1 for x in sent(8))   # below the full batch's floor: at most a probe
