"""End-to-end statistical losslessness of SWIFT sampling on a tiny random model with a 16-token vocabulary.

The exact target distribution of the first two generated tokens is computed from full-model logits; SWIFT
sampling (a skip-set draft that disagrees with the target, siblings drawn without replacement, tree acceptance)
must reproduce it. The same statistic must reject a deliberately wrong acceptance (plain draft sampling).
"""
import math

import pytest
import torch

from swiftk.runtime.config import from_hf_config
from swiftk.engine import Engine
from swiftk.loading.loaders import Checkpoint
from swiftk.moa.method import drafter_path, load_drafter  # noqa: F401

transformers = pytest.importorskip("transformers")
V = 16


class _IdTokenizer:
    """Test scaffolding: ids are the text; nothing ends generation but max_new_tokens."""

    eos_ids: set = set()
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def encode(self, text, add_bos=None):
        return [int(t) for t in text.split()]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model is all per-op overhead; more threads only add synchronisation."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)  # sharper distributions: drafts get accepted sometimes, rejected sometimes
    ck = Checkpoint(config=from_hf_config(cfg.to_dict()), tensors=dict(hf.state_dict()), tokenizer=_IdTokenizer(),
                    identity={"name": "tiny"})
    eng = Engine(ck, max_context=32, optimize=False, max_tree_nodes=8, max_draft=3, eps=0.0, speculate="always")
    s = torch.zeros(8, dtype=torch.bool)
    s[[2, 5]] = True  # attention of layer 1, MLP of layer 2
    eng.skip_set = s
    return eng


def _exact_joint(eng, prompt, temperature):
    p1 = torch.softmax(eng.logits(prompt)[-1] / temperature, -1).double()
    joint = torch.zeros(V, V, dtype=torch.float64)
    for a in range(V):
        joint[a] = p1[a] * torch.softmax(eng.logits(prompt + [a])[-1] / temperature, -1).double()
    return joint


def _chi2_pvalue(counts, probs):
    """Pearson chi-square over cells with expected count >= 5 (the rest pooled)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_cells = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp_cells = torch.cat([exp[big], exp[~big].sum().reshape(1)])
    keep = exp_cells > 0
    stat = float(((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square tail
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _sample_pairs(eng, prompt, n, temperature, method="swift", **kw):
    """Seeds 0..n-1 each draw one sample of the first two tokens."""
    counts = torch.zeros(V * V, dtype=torch.float64)
    stats = {"rounds": 0, "accepted": 0}
    for seed in range(n):
        out = eng.generate(prompt, max_new_tokens=2, method=method, temperature=temperature, seed=seed, **kw)
        a, b = out.token_ids
        counts[a * V + b] += 1
        stats["accepted"] += out.stats["accepted_tokens"]
        for src, k in out.stats.accepted_by_source.items():
            stats[src] = stats.get(src, 0) + k
    return counts, stats


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_swift_sampling_matches_target_joint(engine, rule):
    prompt = [3, 7, 1, 12]
    temperature = 1.0
    exact = _exact_joint(engine, prompt, temperature).flatten()
    counts, st = _sample_pairs(engine, prompt, 3000, temperature, sampling=rule)
    assert st["accepted"] > 0, "the draft never got a token accepted: the test would not exercise acceptance"
    p = _chi2_pvalue(counts, exact)
    tv = 0.5 * float((counts / counts.sum() - exact).abs().sum())
    assert p > 1e-3, (p, tv)


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_moa_sampling_matches_target_joint(engine, rule, tmp_path):
    """The same statistic with the MoA drafter (a random one: its proposals differ from the target's, and with
    TLI = 1 the target's last layer finishes each draft step) plus n-gram candidates in the same tree."""
    from swiftk.moa.model import MoAConfig, MoADrafter, save

    torch.manual_seed(3)
    d = MoADrafter(MoAConfig.for_target(engine.config, d=16, heads=2, mlp=32, lsa_dim=8, tli=1))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.5)
    save(tmp_path / "d.safetensors", d, engine.identity)
    load_drafter(engine.target, tmp_path / "d.safetensors")
    prompt = [3, 7, 3, 7, 3]   # a repeat, so the n-gram source proposes too
    exact = _exact_joint(engine, prompt, 1.0).flatten()
    counts, st = _sample_pairs(engine, prompt, 3000, 1.0, method="moa", sampling=rule, ngram=True)
    assert st["accepted"] > 0, "no draft token was ever accepted: the test would not exercise acceptance"
    assert _chi2_pvalue(counts, exact) > 1e-3


@pytest.mark.parametrize("method", ["ngram", "swift"])
def test_free_sources_sampling_matches_target_joint(engine, method):
    """The same statistic with the free sources in the tree, alone ("ngram") and beside the layer-skip draft:
    context continuations (the prompt repeats), the session's earlier outputs and Token Recycling's successor
    table, all carried by one learned state that keeps learning between samples. (Coupled sampling: tree
    rejection sampling has no rule for deterministic drafts, so it decodes without them.)"""
    st = engine.new_state()
    prompt = [3, 7, 3, 7, 3]
    for seed in range(20):   # fill the successor table and the history
        engine.generate(prompt, max_new_tokens=12, method="ngram", temperature=1.0, seed=1000 + seed, state=st)
    exact = _exact_joint(engine, prompt, 1.0).flatten()
    # the layer draft: one candidate, one step, so free nodes get tree room beside it
    kw = {"max_draft": 1, "topk_sampling": ((0.0, 1),)} if method == "swift" else {}
    counts, got = _sample_pairs(engine, prompt, 3000, 1.0, method=method, state=st, **kw)
    assert got.get("recycle", 0) > 0 and got.get("ngram", 0) + got.get("history", 0) > 0, got
    assert method == "ngram" or got["draft"] > 0, got
    assert _chi2_pvalue(counts, exact) > 1e-3


def test_statistic_rejects_the_draft_distribution(engine):
    """Power check: samples from the *draft* model (what a lossy scheme would emit) fail the same test."""
    prompt = [3, 7, 1, 12]
    exact = _exact_joint(engine, prompt, 1.0).flatten()
    m, cache = engine.model, engine.cache
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(V * V, dtype=torch.float64)
    skip = engine.skip_set
    for _ in range(3000):
        seq = list(prompt)
        for _ in range(2):
            cache.reset()
            T = torch.arange(len(seq))
            logits = m.forward(torch.tensor(seq), T, T, cache, skip=skip)[-1]
            seq.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g)))
        counts[seq[-2] * V + seq[-1]] += 1
    assert _chi2_pvalue(counts, exact) < 1e-6
