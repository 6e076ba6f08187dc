"""kernels/cpu/cpu_decode.cpp (the fused CPU layer loop) against its torch twin (Model._layers op by op), its batch
invariance, partial passes, weight formats and bad input."""
import pytest
import torch

from swiftk.runtime.config import from_hf_config
from swiftk.errors import SwiftkError
from swiftk.runtime.model import Model, TreeMask
from swiftk.runtime.ops import cpu_layers, cpu_linear

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason=f"CPU kernels unavailable: {cpu_linear.status()}")


def _model(arch="llama", weights=None, seed=0, kv_cache=None, **over):
    torch.manual_seed(seed)
    common = dict(vocab_size=97, hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False)   # head_dim 18, I = 100: vector tails everywhere
    common.update(over)
    hf = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)) if arch == "llama"
          else transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    return Model(from_hf_config(hf.config.to_dict()), sd, device="cpu", dtype=torch.float32, weights=weights,
                 kv_cache=kv_cache)


@pytest.fixture
def fused_switch():
    yield cpu_layers.set_fused
    cpu_layers.set_fused(True)


def _both(m, fn):
    """fn(cache) on a fresh cache, op by op and fused: (logits, cache) of each."""
    out = []
    for fused in (False, True):
        cpu_layers.set_fused(fused)
        cache = m.new_cache(64)
        out.append((fn(cache), cache.data.clone()))
    cpu_layers.set_fused(True)
    return out


def _prefix(m, cache, n=11, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, m.cfg.vocab_size, (n,), generator=g)
    m.forward(ids, torch.arange(n), torch.arange(n), cache)
    cache.reset()
    cache.advance(n)
    return n


def _random_tree(T, g):
    """(ancestor matrix [T, T] bool, depths [T]) of a random tree of T nodes, node 0 the root."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
    anc = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        anc[i, i] = True
        if p >= 0:
            anc[i] |= anc[p]
    return anc, anc.sum(1) - 1


@pytest.mark.parametrize("arch,over", [("llama", {}), ("qwen2", {}),
                                       ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 1, "hidden_size": 80}),
                                       ("llama", {"hidden_size": 128}),    # head_dim 32: the vector attention path
                                       # head_dim 64, 7 query heads per KV head: work items of 4 + 3 heads
                                       ("llama", {"hidden_size": 448, "num_attention_heads": 7,
                                                  "num_key_value_heads": 1})])
@pytest.mark.parametrize("T", [1, 5, 17])
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_fused_equals_op_by_op(fused_switch, arch, over, T, kv):
    """Also over a float16 cache: both paths round k, v to nearest even and attend over the widened values (the
    torch path's float32 math on them). A k that the two paths compute a few ulps of float32 apart can round to
    neighbouring halves, so there the tolerance is a half's ulp (2^-11 relative)."""
    m = _model(arch, kv_cache=kv, **over)
    tol = dict(atol=2e-5, rtol=1e-4) if kv == "float32" else dict(atol=1e-3, rtol=1e-3)
    g = torch.Generator().manual_seed(T)
    anc, depth = _random_tree(T, g)
    skip = torch.rand(2 * m.cfg.n_layers, generator=g) < 0.4
    toks = torch.randint(0, m.cfg.vocab_size, (T,), generator=g)

    def tree_pass(cache, sk):
        n = _prefix(m, cache)
        slots = torch.arange(n, n + T)
        return m.forward(toks, n + depth, slots, cache, attn_mask=TreeMask.of(n, anc), skip=sk)

    for sk in (None, skip):
        (ref, kv_ref), (got, kv_got) = _both(m, lambda c: tree_pass(c, sk))
        torch.testing.assert_close(got, ref, **tol)
        torch.testing.assert_close(kv_got, kv_ref, **tol)
        assert kv_got.dtype == getattr(torch, kv)


# head_dim 18 (scalar tails), 32 (vector path), 64 with 7 / 5 / 2 query heads per KV head (a pass of several
# tokens takes up to 4 heads per work item, a single step one: the same bits)
@pytest.mark.parametrize("over", [{}, {"hidden_size": 128},
                                  {"hidden_size": 448, "num_attention_heads": 7, "num_key_value_heads": 1},
                                  {"hidden_size": 640, "num_attention_heads": 10, "num_key_value_heads": 2},
                                  {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}])
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_verify_rows_equal_single_steps_bit_for_bit(fused_switch, over, kv):
    """A chain verified in one pass gives each token the logits it gets decoded alone (the basis of greedy
    speculative output equal to plain decoding, independent of the tree's size), over either cache type."""
    m = _model(kv_cache=kv, **over)
    cache = m.new_cache(64)
    n = _prefix(m, cache)
    toks = torch.tensor([5, 17, 42, 8, 60, 3])
    T = toks.shape[0]
    chain = m.forward(toks, torch.arange(n, n + T), torch.arange(n, n + T), cache,
                      attn_mask=TreeMask.causal(n, T, "cpu"))
    for i in range(T):   # same slots, one token at a time (the chain's KV below i is already in place)
        one = m.forward(toks[i:i + 1], torch.tensor([n + i]), torch.tensor([n + i]), cache, start=n + i)
        assert torch.equal(one[0], chain[i]), i


# head_dim 32, 64 (3 and 7 query heads per KV head) and 128: a pass of several tokens attends in tiles of keys, its
# tokens in blocks per thread count; S = 313 slots is no multiple of a tile or of 16 keys
@pytest.mark.parametrize("over", [{"hidden_size": 128},
                                  {"hidden_size": 384, "num_attention_heads": 6, "num_key_value_heads": 2},
                                  {"hidden_size": 448, "num_attention_heads": 7, "num_key_value_heads": 1},
                                  {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}])
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_tree_rows_equal_single_steps_over_a_long_context(fused_switch, over, kv):
    """Every row of a 12-token tree over 301 cached slots gets the logits of its token decoded alone with the same
    visible slots, bit for bit, on 1 and 2 threads and with the tiles switched off (per-token work items)."""
    m = _model(max_position_embeddings=1024, kv_cache=kv, **over)
    cache = m.new_cache(512)
    n = _prefix(m, cache, n=301)
    T = 12
    g = torch.Generator().manual_seed(5)
    anc, depth = _random_tree(T, g)
    toks = torch.randint(0, m.cfg.vocab_size, (T,), generator=g)
    threads = torch.get_num_threads()
    try:
        tree = []
        for k, tiles in ((1, True), (2, True), (2, False)):
            torch.set_num_threads(k)
            cpu_layers.set_attention_tiles(tiles)
            tree.append(m.forward(toks, n + depth, torch.arange(n, n + T), cache, attn_mask=TreeMask.of(n, anc)))
    finally:
        torch.set_num_threads(threads)
        cpu_layers.set_attention_tiles(True)
    assert torch.equal(tree[0], tree[1]) and torch.equal(tree[0], tree[2])
    for i in range(T):   # the tree's KV is in place: token i alone, seeing the prefix and its ancestors
        vis = torch.cat([torch.ones(n, dtype=torch.bool), anc[i]])[None]
        one = m.forward(toks[i:i + 1], (n + depth[i]).view(1), torch.tensor([n + i]), cache, attn_mask=vis)
        assert torch.equal(one[0], tree[0][i]), i


def test_partial_passes_and_capture(fused_switch):
    m = _model(num_hidden_layers=4)
    toks = torch.tensor([4, 9, 33])

    def run(cache):
        n = _prefix(m, cache)
        pos = torch.arange(n, n + 3)
        mid = m.forward_to(2, toks, pos, pos, cache)
        logits, cap = m.forward(toks, pos, pos, cache, capture_layer=3)
        tail = m.forward_from(2, mid, pos, pos, cache)
        return torch.cat([mid, cap, logits, tail], 1)

    (ref, kv_ref), (got, kv_got) = _both(m, run)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(kv_got, kv_ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_weight_formats(fused_switch, weights):
    m = _model(weights=weights)
    toks = torch.tensor([1, 2, 3, 4])

    def run(cache):
        n = _prefix(m, cache)
        return m.forward(toks, torch.arange(n, n + 4), torch.arange(n, n + 4), cache,
                         attn_mask=TreeMask.causal(n, 4, "cpu"))

    (ref, _), (got, _) = _both(m, run)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_fused_path_serves_passes_and_causal_prefills(fused_switch, monkeypatch):
    """The switch is applied: on, passes of <= 64 tokens (any verify pass) go through the C loop, a longer causal
    prefill as passes of 64; a longer pass with its own mask, or the switch off, runs op by op in torch."""
    m = _model()
    calls = []
    real = cpu_layers.layers_fn

    def spy():
        calls.append(1)
        return real()

    monkeypatch.setattr(cpu_layers, "layers_fn", spy)
    cache = m.new_cache(160)
    m.forward(torch.arange(70) % 90, torch.arange(70), torch.arange(70), cache)   # prefill: 64 + 6
    assert len(calls) == 2
    calls.clear()
    mask = torch.ones(70, 140, dtype=torch.bool).tril(70)
    m.forward(torch.arange(70) % 90, torch.arange(70, 140), torch.arange(70, 140), cache, attn_mask=mask)
    assert not calls
    m.forward(torch.tensor([7]), torch.tensor([140]), torch.tensor([140]), cache, start=140)
    assert calls
    calls.clear()
    fused_switch(False)
    m.forward(torch.tensor([7]), torch.tensor([141]), torch.tensor([141]), cache, start=141)
    assert not calls


@pytest.mark.parametrize("over", [{}, {"hidden_size": 384, "num_attention_heads": 6, "num_key_value_heads": 2}])
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_a_prefill_is_the_prompt_decoded_token_by_token(fused_switch, over, kv):
    """A 150-token prefill (passes of 64 in the C loop) writes the KV cache and last logits that decoding the
    prompt one token at a time gives, bit for bit (what prefix_cache relies on, over either cache type), and
    matches the op-by-op torch pass within float rounding (a half's ulp over a float16 cache)."""
    m = _model(max_position_embeddings=1024, kv_cache=kv, **over)
    tol = dict(atol=1e-4, rtol=1e-4) if kv == "float32" else dict(atol=1e-3, rtol=1e-3)
    P = 150
    ids = torch.randint(0, m.cfg.vocab_size, (P,), generator=torch.Generator().manual_seed(9))
    pos, last = torch.arange(P), torch.tensor([P - 1])
    out = []
    for fused in (False, True):
        cpu_layers.set_fused(fused)
        cache = m.new_cache(P + 8)
        out.append((m.forward(ids, pos, pos, cache, logits_idx=last), cache.data.clone()))
    cpu_layers.set_fused(True)
    (ref, kv_ref), (got, kv_got) = out
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(kv_got[..., :P, :], kv_ref[..., :P, :], **tol)
    cache = m.new_cache(P + 8)
    for i in range(P):
        one = m.forward(ids[i:i + 1], pos[i:i + 1], pos[i:i + 1], cache, start=i)
    assert torch.equal(one, got)
    assert torch.equal(cache.data[..., :P, :], kv_got[..., :P, :])


def test_bad_passes_are_named(fused_switch):
    m = _model()
    cache = m.new_cache(16)
    with pytest.raises(SwiftkError, match="at least one slot"):
        m.forward(torch.tensor([1, 2]), torch.arange(2), torch.arange(2), cache,
                  attn_mask=torch.tensor([[True, False], [False, False]]))
    with pytest.raises(SwiftkError, match="outside the cache"):
        m.forward(torch.tensor([1]), torch.tensor([16]), torch.tensor([16]), cache)
    with pytest.raises(SwiftkError, match="exceeds the cache"):
        m.forward(torch.tensor([1, 2]), torch.arange(15, 17), torch.arange(15, 17), cache,
                  attn_mask=TreeMask.causal(15, 2, "cpu"))


def call_layer_loop(m, cache, table, wtypes, T: int = 2, kv_type: int = 0) -> int:
    """kernels/cpu/cpu_decode.cpp's swk_layers over ``table`` (fused_layer_table's layout, its KV addresses those of
    ``cache``, which the caller keeps alive) for T causal tokens at slots 0..T-1: its return code (0 ran, -1
    refused)."""
    c = m.cfg
    n, hd = table.shape[0], c.head_dim
    fl = torch.zeros(2 * n, dtype=torch.uint8)
    slots = torch.arange(T, dtype=torch.int64)
    cos, sin = torch.ones(T, hd // 2), torch.zeros(T, hd // 2)
    vis = torch.ones(T, T, dtype=torch.uint8).tril().contiguous()
    h = torch.randn(T, c.hidden_size)
    return cpu_layers.layers_fn()(n, table.data_ptr(), wtypes.data_ptr(), fl.data_ptr(), T, c.hidden_size, c.n_heads,
                                  c.n_kv_heads, hd, c.intermediate_size, c.rms_eps, 1.0, cache.max_slots,
                                  slots.data_ptr(), cos.data_ptr(), sin.data_ptr(), vis.data_ptr(), T, h.data_ptr(), 1,
                                  kv_type)


def test_an_int8_weight_without_its_scales_is_refused():
    """The layer loop refuses an int8 matrix whose scale entry is null (it would read through a null pointer),
    and a null matrix, before computing anything."""
    from swiftk.runtime.weights import fused_layer_table

    m = _model(weights="int8")
    cache = m.new_cache(16)   # alive while the loop writes it: the table holds its address only
    table, wtypes = fused_layer_table(m.layers, cache)
    assert int(wtypes[0, 0]) == 2 and call_layer_loop(m, cache, table, wtypes) == 0
    for col in (2, 1):   # the qkv matrix's scales, then the matrix
        bad = table.clone()
        bad[0, col] = 0
        assert call_layer_loop(m, cache, bad, wtypes) == -1


def test_rope_rows_are_the_reference_tables():
    """The fused loop's cos/sin rows come from one table grown on demand: each position's row is exactly what
    reference.rope_cos_sin gives for it, whatever the pass's length or where the table stopped growing."""
    from swiftk.runtime.ops.reference import rope_cos_sin

    m = _model()
    for pos in (torch.arange(5), torch.tensor([4351]), torch.arange(4340, 4400), torch.tensor([9000, 3, 17000]),
                torch.arange(100, 164)):
        cos, sin = m._rope_rows(pos)
        want = rope_cos_sin(pos, m.inv_freq)
        assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    assert m._rope_table[0].shape[0] >= 17001
