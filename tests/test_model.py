"""The hand-written runtime against Hugging Face transformers on tiny random configs, plus slot/mask/skip semantics."""
import pytest
import torch

from swiftk.runtime.config import from_hf_config
from swiftk.runtime.model import Model, TreeMask

transformers = pytest.importorskip("transformers")


def _tiny_hf(arch: str, seed=0, **over):
    torch.manual_seed(seed)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False)
    common.update(over)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    model = model.float().eval()
    # random init leaves some biases at zero; perturb everything so bias handling is exercised
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _ours(hf_model):
    cfg = from_hf_config(hf_model.config.to_dict())
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    return Model(cfg, sd, device="cpu", dtype=torch.float32)


def _ours_logits(m, ids):
    T = len(ids)
    cache = m.new_cache(T + 8)
    t = torch.tensor(ids)
    return m.forward(t, torch.arange(T), torch.arange(T), cache)


CONFIGS = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               "rope_theta": 500000.0}),
    ("qwen2", {}),
    ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 1, "hidden_size": 64}),
]


@pytest.mark.parametrize("arch,over", CONFIGS)
def test_logits_match_transformers(arch, over):
    hf = _tiny_hf(arch, **over)
    m = _ours(hf)
    g = torch.Generator().manual_seed(1)
    for T in (1, 7, 150):  # past 100 positions, so RoPE at larger angles is exercised
        ids = torch.randint(0, 97, (T,), generator=g)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
        ours = _ours_logits(m, ids.tolist())
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), (arch, over, T, err)


def test_incremental_decode_equals_full_forward():
    m = _ours(_tiny_hf("llama"))
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(2))
    full = _ours_logits(m, ids.tolist())
    cache = m.new_cache(32)
    m.forward(ids[:12], torch.arange(12), torch.arange(12), cache)
    rows = []
    for i in range(12, 20):
        rows.append(m.forward(ids[i:i + 1], torch.tensor([i]), torch.tensor([i]), cache)[0])
    torch.testing.assert_close(torch.stack(rows), full[12:], rtol=1e-5, atol=1e-5)


def test_skip_none_and_all_false_equal_full():
    m = _ours(_tiny_hf("qwen2"))
    ids = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(3))
    full = _ours_logits(m, ids.tolist())
    cache = m.new_cache(16)
    none_skip = m.forward(ids, torch.arange(9), torch.arange(9), cache, skip=torch.zeros(6, dtype=torch.bool))
    assert torch.equal(full, none_skip)


@pytest.mark.parametrize("sub", [2, 3])  # attention of layer 1, MLP of layer 1
def test_skipping_a_sublayer_changes_logits_and_matches_manual_skip(sub):
    hf = _tiny_hf("llama")
    m = _ours(hf)
    ids = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(4))
    full = _ours_logits(m, ids.tolist())
    skip = torch.zeros(6, dtype=torch.bool)
    skip[sub] = True
    cache = m.new_cache(16)
    skipped = m.forward(ids, torch.arange(9), torch.arange(9), cache, skip=skip)
    assert (skipped - full).abs().max() > 1e-3
    # independent check: zero the sublayer's output projection in HF == skipping it
    with torch.no_grad():
        layer = hf.model.layers[1]
        proj = layer.self_attn.o_proj if sub == 2 else layer.mlp.down_proj
        proj.weight.zero_()
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(skipped, ref, rtol=1e-4, atol=1e-4)


def test_skip_set_validation():
    m = _ours(_tiny_hf("llama"))
    cache = m.new_cache(8)
    with pytest.raises(ValueError, match="skip set"):
        m.forward(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), cache, skip=torch.zeros(5, dtype=torch.bool))


def test_chain_tree_mask_equals_causal():
    m = _ours(_tiny_hf("llama"))
    ids = torch.randint(0, 97, (14,), generator=torch.Generator().manual_seed(5))
    full = _ours_logits(m, ids.tolist())
    cache = m.new_cache(32)
    m.forward(ids[:6], torch.arange(6), torch.arange(6), cache)
    tm = TreeMask.causal(6, 8, "cpu")
    out = m.forward(ids[6:], torch.arange(6, 14), torch.arange(6, 14), cache, attn_mask=tm)
    torch.testing.assert_close(out, full[6:], rtol=1e-5, atol=1e-5)
    dense = torch.ones(8, 14, dtype=torch.bool)
    dense[:, 6:] = torch.ones(8, 8, dtype=torch.bool).tril()
    out2 = m.forward(ids[6:], torch.arange(6, 14), torch.arange(6, 14), cache, attn_mask=dense)
    torch.testing.assert_close(out2, full[6:], rtol=1e-5, atol=1e-5)


def test_tree_siblings_share_position_own_slots():
    """Two branches verified in one pass equal each branch run alone."""
    m = _ours(_tiny_hf("qwen2"))
    g = torch.Generator().manual_seed(6)
    prefix = torch.randint(0, 97, (5,), generator=g)
    a, b = torch.randint(0, 97, (2,), generator=g).tolist()
    c = int(torch.randint(0, 97, (1,), generator=g))
    # tree: root r (pos 5) -> a (pos 6) -> c (pos 7); root -> b (pos 6)
    r = int(torch.randint(0, 97, (1,), generator=g))
    cache = m.new_cache(32)
    m.forward(prefix, torch.arange(5), torch.arange(5), cache)
    toks = torch.tensor([r, a, b, c])
    parents = [-1, 0, 0, 1]
    anc = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    out = m.forward(toks, torch.tensor([5, 6, 6, 7]), torch.arange(5, 9), cache,
                    attn_mask=TreeMask(5, __import__("swiftk.runtime.ops.reference", fromlist=["x"]).pack_tree_mask(anc)))
    seq1 = _ours_logits(m, prefix.tolist() + [r, a, c])
    seq2 = _ours_logits(m, prefix.tolist() + [r, b])
    torch.testing.assert_close(out[[0, 1, 3]], seq1[5:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[2], seq2[6], rtol=1e-5, atol=1e-5)


def test_non_contiguous_slots_equal_contiguous():
    m = _ours(_tiny_hf("llama"))
    ids = torch.randint(0, 97, (10,), generator=torch.Generator().manual_seed(7))
    full = _ours_logits(m, ids.tolist())
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(8))  # slot of token i = perm[i]
    cache = m.new_cache(16)
    # causal by *position*, expressed over the permuted slots
    mask = torch.zeros(10, 10, dtype=torch.bool)
    for i in range(10):
        mask[i, perm[: i + 1]] = True
    out = m.forward(ids, torch.arange(10), perm, cache, attn_mask=mask)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    # and written one token at a time in a scrambled slot order
    cache2 = m.new_cache(16)
    rows = []
    for i in range(10):
        rows.append(m.forward(ids[i:i + 1], torch.tensor([i]), perm[i:i + 1], cache2, attn_mask=mask[i:i + 1])[0])
    torch.testing.assert_close(torch.stack(rows), full, rtol=1e-5, atol=1e-5)


def test_logits_idx_selects_rows():
    m = _ours(_tiny_hf("llama"))
    ids = torch.randint(0, 97, (6,), generator=torch.Generator().manual_seed(9))
    full = _ours_logits(m, ids.tolist())
    cache = m.new_cache(8)
    out = m.forward(ids, torch.arange(6), torch.arange(6), cache, logits_idx=torch.tensor([5]))
    assert out.shape == (1, 97)
    torch.testing.assert_close(out[0], full[5], rtol=1e-6, atol=1e-6)


def test_cache_storage_is_never_reallocated():
    m = _ours(_tiny_hf("llama"))
    cache = m.new_cache(16)
    ptr = cache.data.data_ptr()
    ids = torch.randint(0, 97, (6,))
    m.forward(ids, torch.arange(6), torch.arange(6), cache)
    m.forward(ids[:2], torch.tensor([6, 6]), torch.tensor([6, 7]), cache, attn_mask=TreeMask.causal(6, 2, "cpu"))
    assert cache.data.data_ptr() == ptr


def test_commit_moves_an_accepted_path_into_place_and_skips_one_already_there(monkeypatch):
    """KVCache.commit: a path off the first branch (nodes 0, 2, 3) is gathered into slots n.. n+2; nodes 0..L-1
    already sit there (node i in slot n + i), so no copy runs."""
    m = _ours(_tiny_hf("llama"))
    cache = m.new_cache(16)
    cache.data.copy_(torch.randn_like(cache.data))
    cache.advance(4)
    copies = []
    real = cache._ops.kv_commit
    monkeypatch.setattr(cache._ops, "kv_commit", lambda *a: (copies.append(1), real(*a)))
    before = cache.data.clone()
    cache.commit(torch.tensor([0, 1, 2]))
    assert not copies and torch.equal(cache.data, before) and cache.length == 7
    cache.commit(torch.tensor([0, 2, 3]))
    assert copies and cache.length == 10
    torch.testing.assert_close(cache.data[..., 7:10, :], before[..., [7, 9, 10], :], rtol=0, atol=0)
