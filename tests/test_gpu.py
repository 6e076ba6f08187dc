"""The decode loop on a CUDA device: CUDA graphs against eager passes, greedy output against transformers (float32)
and against swiftk's own autoregressive decoding (bfloat16), every backend.

All marked ``gpu`` and skipped without a CUDA device. Tolerances: logits of a graphed pass vs the same pass run
eagerly, |diff| <= 1e-3 * (1 + |ref|) in float32 (the graph attends over a padded slot range: masked slots weigh
exactly zero, but reduction lengths differ). Greedy output in bfloat16 may leave float32 transformers' at a near tie;
it must equal swiftk's bfloat16 autoregressive output except where that output's own top-2 logits are within
bfloat16 rounding (two units in the last place at the top logit's magnitude: 0.5 for logits in [32, 64)), checked at
the first difference: a verify pass of T tokens and a step of one run different matmul tilings, so their bfloat16
roundings differ, and a near tie can go either way.
"""
import pytest
import torch

import swiftk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\ndef mean(xs):",
           "Write a haiku about the sea.", "for i in range(10):"]


@pytest.fixture(scope="module")
def cuda_engines(smollm2_path):
    graphs = swiftk.load(str(smollm2_path), device="cuda", dtype="float32", cuda_graphs=True)
    eager = swiftk.load(str(smollm2_path), device="cuda", dtype="float32", cuda_graphs=False)
    return graphs, eager


def _close(a, b, tol=1e-3):
    ratio = ((a.float() - b.float()).abs() / (1 + b.float().abs())).max().item()
    assert ratio <= tol, ratio


def test_graphed_passes_equal_eager_passes(cuda_engines):
    """Plain step, draft step (skip set, reduced-vocabulary head) and tree verify: graph replay == eager."""
    from swiftk.runtime.ops.masks import TreeMask

    g_eng, e_eng = cuda_engines
    ids = g_eng.tokenizer.encode(PROMPTS[0])
    out = {}
    for name, eng in (("graph", g_eng), ("eager", e_eng)):
        m, cache = eng.model, eng.cache
        n = len(ids)
        ar = torch.arange(n, device="cuda")
        m.forward(torch.tensor(ids, device="cuda"), ar, ar, cache)
        cache.reset()
        cache.advance(n)
        pos = torch.tensor([n], device="cuda")
        step = m.forward(torch.tensor([ids[-1]], device="cuda"), pos, pos, cache, start=n)
        skip = eng.states.from_layers(attention=[3, 5, 7], mlp=[4, 6]).to("cuda")
        draft = m.forward(torch.tensor([7], device="cuda"), pos, pos, cache, skip=skip, start=n)
        anc = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                           dtype=torch.bool, device="cuda")
        toks = torch.tensor([5, 9, 11, 13, 17], device="cuda")
        verify = m.forward(toks, n + anc.sum(1) - 1, torch.arange(n, n + 5, device="cuda"), cache,
                           attn_mask=TreeMask.of(n, anc))
        out[name] = (step, draft, verify)
    for a, b in zip(out["graph"], out["eager"]):
        _close(a, b)
    info = g_eng.model.graphs.info()
    assert info["captured"] >= 3 and info["replayed"] >= 3 and info["capture_failed"] is None, info
    assert e_eng.model.graphs is None


def test_plain_graphs_are_captured_at_load_and_serve_every_length(smollm2_path):
    """One graph per T bucket serves every cache length: decodes across many 256-slot spans capture nothing after
    load, and the graphed steps give the eager engine's output."""
    from swiftk.runtime.graphs import T_BUCKETS

    graphs = swiftk.load(str(smollm2_path), device="cuda", dtype="float32", cuda_graphs=True)
    eager = swiftk.load(str(smollm2_path), device="cuda", dtype="float32", cuda_graphs=False)
    assert graphs.model.graphs.info()["captured"] == len(T_BUCKETS)
    a = graphs.generate(PROMPTS[0], max_new_tokens=600, method="autoregressive", stop=[]).token_ids
    b = eager.generate(PROMPTS[0], max_new_tokens=600, method="autoregressive", stop=[]).token_ids
    assert a == b and len(a) == 600
    graphs.generate(PROMPTS[0], max_new_tokens=600, method="ngram", stop=[])   # verify passes of every size
    info = graphs.model.graphs.info()
    assert info["captured"] == len(T_BUCKETS) and info["replayed"] > 600 and not info["eager"], info


@pytest.mark.parametrize("method", ["autoregressive", "swift", "ngram"])
def test_greedy_on_cuda_equals_transformers_float32(cuda_engines, smollm2_path, method):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                           dtype=torch.float32).to("cuda").eval()
    g_eng, _ = cuda_engines
    kw = {"speculate": "always"} if method == "swift" else {}
    for p in PROMPTS[:3]:
        ids = g_eng.tokenizer.encode(p)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=48, do_sample=False,
                              pad_token_id=0)[0, len(ids):].tolist()
        got = g_eng.generate(p, max_new_tokens=48, method=method, stop=[], **kw).token_ids
        assert got == ref[:len(got)] and len(got) == len(ref), (p, method)


@pytest.mark.parametrize("backend", ["torch", "triton", "cupy", "cuda"])
def test_bfloat16_speculative_equals_bfloat16_autoregressive(smollm2_path, backend, monkeypatch):
    """Every backend: SWIFT (forced drafting) and n-gram output == swiftk's own bfloat16 AR, up to near ties."""
    from swiftk.runtime import ops
    from swiftk.errors import SwiftkError

    monkeypatch.setenv("SWIFTK_BACKEND", backend)
    ops.clear_cache()
    try:
        eng = swiftk.load(str(smollm2_path), device="cuda", dtype="bfloat16")
    except SwiftkError as e:
        pytest.skip(f"backend {backend} not usable here: {e}")
    assert backend in eng.info()["backends"].values() or backend == "torch"
    for p in PROMPTS:
        ar = eng.generate(p, max_new_tokens=64, method="autoregressive", stop=[]).token_ids
        for method, kw in (("swift", {"speculate": "always"}), ("ngram", {})):
            got = eng.generate(p, max_new_tokens=64, method=method, stop=[], **kw).token_ids
            if got == ar:
                continue
            i = next(k for k, (a, b) in enumerate(zip(got, ar)) if a != b)
            ids = eng.tokenizer.encode(p) + ar[:i]
            logits = eng.logits(ids)[-1].float()
            top2 = torch.topk(logits, 2).values
            ulp = 2.0 ** (torch.floor(torch.log2(top2[0].abs())).item() - 7)   # bfloat16: 8 significant bits
            assert (top2[0] - top2[1]).item() <= 2 * ulp, (backend, method, p, i, top2.tolist())
    ops.clear_cache()
