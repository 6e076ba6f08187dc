"""Drafting modes beyond on-the-fly SWIFT: early exit, static (Self-SD) skip sets, the KVQ cache, swiftk optimize."""
import json

import pytest
import torch

import swiftk
import swiftk.runtime.model as model_mod
from swiftk.runtime.ops import cpu_layers
from swiftk.cli import main as cli_main
from swiftk.proposers.draft_loop import draft
from swiftk.errors import SwiftkError
from swiftk.options import DecodeConfig
from swiftk.decoding.gate import Gate
from swiftk.sample.sampler import Sampler, SamplingParams
from swiftk.runtime.skipset import kvq_boundary
from swiftk.decoding.loop import verify
from swiftk.decoding.state import GateMemory
from swiftk.decoding.tree import GREEDY_TOPK, build_tree

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_prime(n: int) -> bool:\n",
    "from typing import List\n\n\ndef mean(xs: List[float]) -> float:\n",
    "The history of the Roman Empire",
    "Explain how a hash table works.",
    "My favourite recipe for pancakes is",
    "In 1969, the first humans",
    "A list of tips for writing clean code:\n1.",
    "class Stack:\n    def __init__(self):\n",
    "Photosynthesis is the process by which",
]


@pytest.fixture(scope="module")
def eng(smollm2_path):
    return swiftk.load(str(smollm2_path), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def static_set(eng):
    """A fixed mixed skip set (what a Self-SD search could return): attention and MLP sublayers, boundary 3."""
    return eng.states.from_layers(attention=[3, 6, 9, 12, 15, 18, 21, 24, 27], mlp=[5, 10, 14, 19, 23, 26])


@pytest.fixture(scope="module")
def ar_ref(eng):
    return {p: eng.generate(p, max_new_tokens=128, method="autoregressive").token_ids for p in PROMPTS}


def test_early_exit_and_static_identical_to_autoregressive_with_and_without_kvq(eng, static_set, ar_ref):
    E = eng.config.n_layers // 2
    for p in PROMPTS:
        for kvq in (False, True):
            # speculate="always": every round drafts, so KVQ reuse is exercised (the gate would stop drafting
            # these poor drafts; test_swift covers the gate on real weights)
            ee = eng.generate(p, max_new_tokens=128, method="early_exit", exit_layer=E, kvq=kvq, speculate="always")
            st = eng.generate(p, max_new_tokens=128, method="static", skip_set=static_set, kvq=kvq,
                              speculate="always")
            assert ee.token_ids == ar_ref[p], (p[:30], "early_exit", kvq)
            assert st.token_ids == ar_ref[p], (p[:30], "static", kvq)
            assert ee.stats["method"] == "early_exit" and ee.stats["exit_layer"] == E
            assert ee.stats["skip_set"]["attention"] == list(range(E, eng.config.n_layers))
            assert st.stats["skip_set"]["mlp"] == [5, 10, 14, 19, 23, 26]
            assert st.stats["optimization_steps"] is None  # fixed sets never optimize
            assert ee.stats["drafted_tokens"] > 0 and st.stats["drafted_tokens"] > 0


class _RowCounter:
    """Counts the token rows every weight matrix is applied to (the model's matmuls all go through linear)."""

    def __init__(self, monkeypatch):
        self.rows = {}
        orig = model_mod.linear

        def counting(x, w):
            self.rows[id(w)] = self.rows.get(id(w), 0) + x.shape[0]
            return orig(x, w)

        monkeypatch.setattr(model_mod, "linear", counting)

    def of(self, w):
        return self.rows.get(id(w), 0)


@pytest.fixture(scope="module")
def eng_f32(smollm2_path):
    # float32 activations: the op-by-op loop the row counter needs matches the fused one up to rounding (with int8
    # activations an ulp can flip an activation's rounding; KVQ's losslessness there is the test above)
    return swiftk.load(str(smollm2_path), device="cpu", dtype="float32", activations="float32")


@pytest.mark.parametrize("mode", ["early_exit", "skip_set"])
def test_kvq_verify_skips_layers_below_boundary_for_drafted_spine(eng_f32, static_set, monkeypatch, mode):
    eng = eng_f32
    m, cache = eng.model, eng.cache
    L = eng.config.n_layers
    skip = eng.states.early_exit(L // 2) if mode == "early_exit" else static_set
    f = kvq_boundary(skip)
    assert f == (L // 2 if mode == "early_exit" else 3)
    ids = eng.tokenizer.encode(PROMPTS[0])
    P = len(ids)
    sampler = Sampler(SamplingParams(0.0).validate(), "cpu")
    gate = Gate(eng.costs, GateMemory(), DecodeConfig(speculate="always", eps=0.0))

    def one_round(boundary):
        cache.reset()
        m.forward(torch.tensor(ids[:-1]), torch.arange(P - 1), torch.arange(P - 1), cache)
        cache.reset()
        cache.advance(P - 1)
        levels = draft(m, cache, ids[-1], skip, sampler, gate, lambda p: p, 0.0, max_draft=6, max_spine=63,
                       topk_bins=GREEDY_TOPK, boundary=boundary)
        tree = build_tree(ids[-1], levels, P - 1, 64, m.device)
        counter = _RowCounter(monkeypatch)
        cpu_layers.set_fused(False)   # the row counter sees the op-by-op loop's matmuls (the fused one calls C)
        try:
            logits = verify(m, cache, tree, levels, boundary)
        finally:
            cpu_layers.set_fused(True)
        monkeypatch.undo()
        return tree, counter, logits

    tree, plain, ref = one_round(None)
    tree2, kvq, got = one_round(f)
    assert torch.equal(tree.tokens, tree2.tokens) and tree.n_spine == 6
    N, ns = tree.size, tree.n_spine
    for li in range(L):
        want = N - ns if li < f else N
        assert plain.of(m.layers[li].wqkv) == N
        assert kvq.of(m.layers[li].wqkv) == want, li
        assert kvq.of(m.layers[li].w_down) == want, li
    assert kvq.of(m.lm_head) == N
    # the reused exit states give the same logits (up to matmul order) and the same argmax
    assert torch.allclose(got, ref, atol=1e-3 * ref.abs().max().item())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_mode_argument_errors(eng, static_set, tmp_path):
    L = eng.config.n_layers
    for bad in (0, L, -1, 2.5, True):
        with pytest.raises(SwiftkError, match="exit_layer must be an int"):
            eng.generate("hi", max_new_tokens=2, method="early_exit", exit_layer=bad)
    with pytest.raises(SwiftkError, match="needs exit_layer"):
        eng.generate("hi", max_new_tokens=2, method="early_exit")
    with pytest.raises(SwiftkError, match="exit_layer is an option"):
        eng.generate("hi", max_new_tokens=2, method="swift", exit_layer=3)
    with pytest.raises(SwiftkError, match="needs skip_set"):
        eng.generate("hi", max_new_tokens=2, method="static")
    with pytest.raises(SwiftkError, match="without optimizing"):
        eng.generate("hi", max_new_tokens=2, method="swift", skip_set=static_set, optimize=True)
    with pytest.raises(SwiftkError, match="not 'autoregressive'"):
        eng.generate("hi", max_new_tokens=2, method="autoregressive", skip_set=static_set)
    with pytest.raises(SwiftkError, match="bool of shape"):
        eng.generate("hi", max_new_tokens=2, method="static", skip_set=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(SwiftkError, match="cannot be skipped"):
        eng.generate("hi", max_new_tokens=2, method="static", skip_set={"attention": [0]})


def test_skip_set_file_errors(eng, tmp_path):
    good = tmp_path / "good.json"
    eng.states.save_skip_set(good)
    assert good.stat().st_mode & 0o044  # readable by others, not mkstemp's 0600
    data = json.loads(good.read_text())
    cases = {
        "malformed": ("{not json", "skip set file .* is not valid JSON"),
        "array": ("[1, 2]", "must hold a JSON object, got array"),
        "wrong_model": (json.dumps({**data, "model": {"name": "other-model"}}), "is for model 'other-model'"),
        "wrong_length": (json.dumps({**data, "n_layers": 7}), "with 7 layers"),
        "out_of_range": (json.dumps({**data, "attention": [99]}), "layer 99 cannot be skipped"),
        "not_a_list": (json.dumps({**data, "mlp": "3,4"}), "must be a list of layer indices"),
    }
    for name, (text, msg) in cases.items():
        p = tmp_path / f"{name}.json"
        p.write_text(text)
        with pytest.raises(SwiftkError, match=msg):
            eng.states.read_skip_set(p)
        with pytest.raises(SwiftkError, match=msg):
            eng.generate("hi", max_new_tokens=2, method="static", skip_set=str(p))
    with pytest.raises(SwiftkError, match="cannot read skip set"):
        eng.states.read_skip_set(tmp_path / "missing.json")


# ---------------------------------------------------------------- swiftk optimize on a tiny model


def test_swiftk_optimize_cli_writes_a_loadable_set_and_resumes(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "calib.txt"
    prompts.write_text("w3 w4 w5 w6\n\nw10 w11 w12\n")
    out = tmp_path / "set.json"
    args = ["optimize", "--model", str(tiny_dir), "--prompts", str(prompts), "--out", str(out),
            "--iterations", "4", "--init", "2", "--max-new-tokens", "8"]
    torch.set_num_threads(1)
    assert cli_main(args) == 0
    data = json.loads(out.read_text())
    state = json.loads((tmp_path / "set.json.state.json").read_text())
    assert len(state["history"]) == 4 and data["objective"]["iterations"] == 4
    assert data["objective"]["tokens_per_s"] == max(h["tokens_per_s"] for h in state["history"])
    eng = swiftk.load(str(tiny_dir))
    s = eng.states.read_skip_set(out)
    assert s.shape == (12,) and not s[:2].any() and not s[-2:].any()
    # the file drives method="static", and swiftk generate --method static accepts it
    r = eng.generate("w3 w4 w5", max_new_tokens=8, method="static", skip_set=str(out))
    assert r.token_ids == eng.generate("w3 w4 w5", max_new_tokens=8, method="autoregressive").token_ids
    capsys.readouterr()
    assert cli_main(["generate", "w3 w4", "--model", str(tiny_dir), "--method", "static", "--skip-set", str(out),
                     "-n", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["method"] == "static"
    # resume: a larger budget evaluates only the missing points
    assert cli_main(args[:-5] + ["6", "--init", "2", "--max-new-tokens", "8"]) == 0
    state = json.loads((tmp_path / "set.json.state.json").read_text())
    assert len(state["history"]) == 6


def test_swiftk_optimize_bad_inputs(tiny_dir, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    out = tmp_path / "x.json"
    assert cli_main(["optimize", "--model", str(tiny_dir), "--prompts", str(empty), "--out", str(out)]) == 2
    assert "holds no prompt" in capsys.readouterr().err
    bad_state = tmp_path / "bad.state.json"
    bad_state.write_text('{"version": 1, "model": "someone-else", "n_coords": 3, "history": []}')
    p = tmp_path / "p.txt"
    p.write_text("w1 w2\n")
    assert cli_main(["optimize", "--model", str(tiny_dir), "--prompts", str(p), "--out", str(out),
                     "--state", str(bad_state), "--iterations", "1"]) == 2
    assert "search state" in capsys.readouterr().err
    assert not out.exists()
