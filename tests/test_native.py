"""weights="native": a GGUF file's block-format matrices used as they are (weights.BlockWeight inside the fused layer
loop and op by op), with float32 activations (kernels/cpu/cpu_quant.cpp; reference: the same file dequantized to float32)
and with int8 activations (kernels/cpu/cpu_qdot.cpp, the default; close to the float32 model, lossless to itself)."""
import gguf
import gguf.quants as gq
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import swiftk
from swiftk.errors import SwiftkError
from swiftk.loading.loaders import load_checkpoint
from swiftk.runtime.model import Model
from swiftk.runtime.ops import cpu_layers, cpu_quant
from swiftk.runtime.weights import BlockWeight
from test_loaders import llama_permute, tiny_vocab

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason=f"CPU quant kernel: {cpu_quant.status()}")

# K-quant blocks hold 256 elements: every matrix dimension the blocks run along is a multiple of 256
D, H, KV, HD, I, L = 256, 4, 2, 64, 512, 3
FORMATS = list(cpu_quant.TYPES)
# a Q4_K_M-like mix: v and down in other formats than q/k and gate/up (several row groups in one fused matrix)
MIXED = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_0", "gate_proj": "Q4_1",
         "up_proj": "Q8_0", "down_proj": "Q6_K", "embed_tokens": "Q8_0", "lm_head": "Q5_K"}


def _quantize(arr: np.ndarray, name: str, rng) -> np.ndarray:
    """gguf's own quantization where the package has one; else blocks whose dequantization is close to ``arr``'s
    scale: random quants under float16 scales sized so the weights come out ~N(0, 1/sqrt(K))-like."""
    t = Q[name]
    try:
        return gq.quantize(arr, t)
    except NotImplementedError:
        pass
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    rows, K = arr.shape
    raw = rng.integers(0, 256, (rows, K // bs, ts), dtype=np.uint8)
    f16 = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[name]
    for off in f16:
        v = rng.uniform(2e-4, 1e-3, raw.shape[:2]) * (1 if off == f16[0] else -1)
        raw[:, :, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write_quant_gguf(path, arch: str, fmt) -> int:
    """A tiny model whose matrices are all ``fmt`` (a format name, or a dict per tensor kind); returns the bytes
    of its block tensors."""
    rng = np.random.default_rng(len(str(fmt)) + len(arch))
    toks, types, merges = tiny_vocab()
    V = len(toks)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(toks.index("<|endoftext|>"))
    w.add_eos_token_id(toks.index("<|im_end|>"))
    w.add_add_bos_token(False)
    r = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)  # noqa: E731
    mats = {"token_embd.weight": ("embed_tokens", r(V, D) * 8), "output.weight": ("lm_head", r(V, D) * 4)}
    vecs = {"output_norm.weight": 1 + 0.1 * r(D)}
    for i in range(L):
        b = f"blk.{i}."
        mats[b + "attn_q.weight"] = ("q_proj", llama_permute(r(H * HD, D), H) if arch == "llama" else r(H * HD, D))
        mats[b + "attn_k.weight"] = ("k_proj", llama_permute(r(KV * HD, D), KV) if arch == "llama" else r(KV * HD, D))
        mats[b + "attn_v.weight"] = ("v_proj", r(KV * HD, D))
        mats[b + "attn_output.weight"] = ("o_proj", r(D, H * HD))
        mats[b + "ffn_gate.weight"] = ("gate_proj", r(I, D))
        mats[b + "ffn_up.weight"] = ("up_proj", r(I, D))
        mats[b + "ffn_down.weight"] = ("down_proj", r(D, I))
        vecs[b + "attn_norm.weight"] = 1 + 0.1 * r(D)
        vecs[b + "ffn_norm.weight"] = 1 + 0.1 * r(D)
        if arch == "qwen2":
            for n, m in (("q", H), ("k", KV), ("v", KV)):
                vecs[b + f"attn_{n}.bias"] = 0.1 * r(m * HD)
    total = 0
    for name, (kind, arr) in mats.items():
        qt = fmt[kind] if isinstance(fmt, dict) else fmt
        qa = _quantize(arr, qt, rng)
        w.add_tensor(name, qa, raw_shape=qa.shape, raw_dtype=Q[qt])
        total += qa.nbytes
    for name, arr in vecs.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("native")
    out = {}
    for fmt in FORMATS + ["mixed"]:
        arch = "qwen2" if fmt in ("Q5_0", "Q5_K", "mixed") else "llama"
        p = d / f"tiny-{fmt}.gguf"
        out[fmt] = (p, write_quant_gguf(p, arch, MIXED if fmt == "mixed" else fmt))
    return out


def _models(path, activations="float32"):
    nat, ref = load_checkpoint(path, native=True), load_checkpoint(path)
    return Model(nat.config, nat.tensors, weights="native", activations=activations), Model(ref.config, ref.tensors)


def _run(model, ids):
    """Logits of a prefill of ``ids[:-3]`` then three one-token steps and a 3-token pass re-reading them."""
    cache = model.new_cache(64)
    n = len(ids) - 3
    out = [model.forward(torch.tensor(ids[:n]), torch.arange(n), torch.arange(n), cache)]
    for i in range(n, len(ids)):
        out.append(model.forward(torch.tensor([ids[i]]), torch.tensor([i]), torch.tensor([i]), cache, start=i))
    out.append(model.forward(torch.tensor(ids[n:]), torch.arange(n, len(ids)), torch.arange(n, len(ids)), cache))
    return torch.cat(out)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "op-by-op"])
@pytest.mark.parametrize("fmt", FORMATS + ["mixed"])
def test_native_equals_the_dequantized_float32_path(files, fmt, fused):
    path, block_bytes = files[fmt]
    nat, ref = _models(path)
    # every matrix stays in blocks: nothing but norms and biases is float
    assert isinstance(nat.embed, BlockWeight) and isinstance(nat.lm_head, BlockWeight)
    assert all(isinstance(m, BlockWeight) for Lr in nat.layers for m in (Lr.wqkv, Lr.wo, Lr.w_gate_up, Lr.w_down))
    assert sum(w.nbytes for w in {id(w): w for w in [nat.embed, nat.lm_head]}.values()) + sum(
        m.nbytes for Lr in nat.layers for m in (Lr.wqkv, Lr.wo, Lr.w_gate_up, Lr.w_down)) == block_bytes
    if fmt == "mixed":
        assert [int(t) for t in nat.layers[0].wqkv.types] == [Q.Q4_K, Q.Q6_K]
    ids = [5, 77, 130, 9, 200, 41, 3, 88, 250, 17, 60, 99]
    was = cpu_layers.fused_active()
    cpu_layers.set_fused(fused)
    try:
        got, want = _run(nat, ids), _run(ref, ids)
    finally:
        cpu_layers.set_fused(was)
    assert torch.isfinite(want).all() and want.abs().max() > 1.0
    # float32 accumulation in another order: errors far below the logits' spread
    err = (got - want).abs().max() / want.abs().max()
    assert err < 2e-4, f"{fmt}: relative error {err:.2e}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("fmt", FORMATS + ["mixed"])
def test_int8_activations_are_close_to_the_float32_path(files, fmt):
    """int8 activations: a slightly different numerical model, within a few percent of the float32 path's logits
    (formats gguf quantizes; the others' random test blocks make a chaotic model); the fused loop and the op-by-op
    loop (prefills) agree closely: an ulp of difference before a linear can flip one activation's rounding, which
    moves an output by one quantization step of its block."""
    path, _ = files[fmt]
    nat, ref = _models(path, "int8")
    assert nat.activations == "int8" and all(m.act == "int8" for Lr in nat.layers for m in (Lr.wqkv, Lr.w_down))
    ids = [5, 77, 130, 9, 200, 41, 3, 88, 250, 17, 60, 99]
    was = cpu_layers.fused_active()
    try:
        cpu_layers.set_fused(True)
        fused = _run(nat, ids)
        cpu_layers.set_fused(False)
        loop = _run(nat, ids)
    finally:
        cpu_layers.set_fused(was)
    want = _run(ref, ids)
    assert (fused - loop).abs().max() / loop.abs().max() < 0.05
    err = (fused - want).abs().max() / want.abs().max()
    assert err > 0
    if fmt in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K"):
        assert err < 0.05, f"{fmt}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", ["Q4_1", "mixed"])
def test_a_long_prefill_takes_the_gemm_panels_and_agrees(files, fmt):
    """Passes of >= cpu_quant.PANEL_MIN_ROWS rows de-quantize panels for torch's GEMM: the logits, and the KV cache
    the next step reads, still match the float32 path."""
    from swiftk.runtime.ops import cpu_quant

    nat, ref = _models(files[fmt][0])
    n = cpu_quant.PANEL_MIN_ROWS + 5
    ids = torch.tensor([(7 * i + 3) % 250 + 1 for i in range(n + 1)])
    out = []
    for m in (nat, ref):
        cache = m.new_cache(n + 8)
        a = m.forward(ids[:n], torch.arange(n), torch.arange(n), cache)
        b = m.forward(ids[n:], torch.tensor([n]), torch.tensor([n]), cache, start=n)
        out.append(torch.cat([a, b]))
    got, want = out
    err = (got - want).abs().max() / want.abs().max()
    assert err < 2e-4, f"{fmt}: relative error {err:.2e}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_native_decoding_is_lossless_and_follows_the_file(files):
    """Greedy: speculative decoding on native weights equals its own autoregressive output, and that equals the
    float32 path's wherever the float32 path's top-2 margin is not a near tie."""
    path, _ = files["mixed"]
    nat = swiftk.load(str(path), weights="native", activations="float32", persist=False)
    flt = swiftk.load(str(path), weights="float32", persist=False)
    prompt = "the the the t he the"
    a = nat.generate(prompt, max_new_tokens=40, method="autoregressive")
    assert nat.generate(prompt, max_new_tokens=40).token_ids == a.token_ids
    b = flt.generate(prompt, max_new_tokens=40, method="autoregressive")
    _agree_until_near_tie(flt, a.prompt_ids, b.token_ids, a.token_ids)
    i8 = swiftk.load(str(path), persist=False)   # the default: int8 activations, lossless to its own AR
    assert i8.info()["activations"] == "int8"
    c = i8.generate(prompt, max_new_tokens=40, method="autoregressive")
    assert i8.generate(prompt, max_new_tokens=40).token_ids == c.token_ids


def test_the_layer_loop_checks_block_descriptors(files):
    """A block matrix's descriptor must cover the layer's rows exactly, in known formats whose blocks divide K: the
    C layer loop refuses it otherwise before computing anything (it would write past the pass's output, or leave
    columns unwritten where the block kernel refused a part mid-pass)."""
    from swiftk.runtime.weights import fused_layer_table
    from test_cpu_decode import call_layer_loop

    nat, _ = _models(files["mixed"][0], activations="int8")
    cache = nat.new_cache(16)   # alive while the loop writes it: the table holds its address only
    table, wtypes = fused_layer_table(nat.layers, cache)
    assert int(wtypes[0, 0]) == 3 and call_layer_loop(nat, cache, table, wtypes) == 0
    desc = nat.layers[0].wqkv.descriptor
    last = 3 * int(desc[0])   # the last part's rows
    for at, delta in ((last, 1), (last, -1), (last - 1, 99 - int(desc[last - 1])), (0, -int(desc[0]))):
        bad_desc = desc.clone()
        bad_desc[at] += delta
        bad = table.clone()
        bad[0, 1] = bad_desc.data_ptr()
        assert call_layer_loop(nat, cache, bad, wtypes) == -1, (at, delta)


def test_info_reports_formats_and_resident_bytes(files):
    path, block_bytes = files["mixed"]
    info = swiftk.load(str(path), weights="native", persist=False).info()
    assert info["weights"] == "native" and info["activations"] == "int8"
    assert info["arithmetic"].startswith("Q4_1/Q4_K/Q5_0/Q5_K/Q6_K/Q8_0 blocks x int8 activations (integer dot")
    fm = info["weight_formats"]
    assert fm["blk.*.attn_qkv"] == ["Q4_K", "Q6_K"] and fm["blk.*.ffn_gate_up"] == ["Q4_1", "Q8_0"]
    assert fm["output"] == ["Q5_K"] and fm["token_embd"] == ["Q8_0"] and fm["output_norm"] == ["F32"]
    assert block_bytes <= info["resident_weight_bytes"] <= 1.1 * block_bytes + 64 * 1024


def test_a_damaged_block_tensor_is_named(files, tmp_path):
    path, _ = files["Q8_0"]
    data = bytearray(path.read_bytes())
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(bytes(data[:-4096]))
    with pytest.raises(SwiftkError, match=r"truncated.*tensor (blk\.1\.|output|token_embd)"):
        swiftk.load(str(cut), weights="native", persist=False)
    # a tensor whose index says Q4_0 while its data is Q8_0: the sizes no longer add up, and the message says where
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    t_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[t_at:t_at + 4], "little") == Q.Q8_0
    data[t_at:t_at + 4] = int(Q.Q4_0).to_bytes(4, "little")
    bad = tmp_path / "mistyped.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(SwiftkError, match=r"blk\.0\.attn_q\.weight"):
        swiftk.load(str(bad), weights="native", persist=False)


def test_native_needs_block_tensors(tiny_dir):
    with pytest.raises(SwiftkError, match="native"):
        swiftk.load(str(tiny_dir), weights="native", persist=False)


def _agree_until_near_tie(flt, prompt_ids, want, got, rel=1e-4):
    """``got`` equals ``want`` (the float32 path's greedy tokens) up to and including the first step whose float32
    top-2 logit margin is a near tie (there the two summation orders may rightly pick different tokens)."""
    ids = prompt_ids + want
    logits = flt.model.forward(torch.tensor(ids), torch.arange(len(ids)), torch.arange(len(ids)),
                               flt.model.new_cache(len(ids)))[len(prompt_ids) - 1:-1]
    top = logits.topk(2, dim=-1).values
    close = ((top[:, 0] - top[:, 1]) < rel * logits.abs().max()).nonzero()
    upto = int(close[0]) if len(close) else len(want)
    assert got[:upto + 1] == want[:upto + 1], (upto, got, want)


def test_real_file_native_is_the_default_and_decodes_as_the_float32_path(smollm2_path):
    """SmolLM2-135M's Q4_1 file: native with int8 activations by default, resident weights within 1.1x the file;
    with float32 activations its greedy output equals the dequantized float32 path's (up to a near tie),
    autoregressive and speculative."""
    dflt = swiftk.load(str(smollm2_path), persist=False)
    assert dflt.info()["weights"] == "native" and dflt.info()["activations"] == "int8"
    nat = swiftk.load(str(smollm2_path), persist=False, activations="float32")
    flt = swiftk.load(str(smollm2_path), persist=False, weights="float32")
    assert nat.info()["weights"] == "native" and flt.info()["weights"] is None
    assert nat.info()["resident_weight_bytes"] <= 1.1 * smollm2_path.stat().st_size
    for prompt in ("def is_prime(n):\n", "Write a short story about a robot learning to paint."):
        want = flt.generate(prompt, max_new_tokens=32, method="autoregressive")
        for method in ("autoregressive", "swift"):
            got = nat.generate(prompt, max_new_tokens=32, method=method)
            _agree_until_near_tie(flt, want.prompt_ids, want.token_ids, got.token_ids)


def test_a_nan_block_scale_is_named(files, tmp_path):
    from swiftk.loading.gguf import read_gguf

    path, _ = files["Q4_1"]
    t = next(t for t in read_gguf(path).tensors if t.name == "blk.2.ffn_up.weight")
    data = bytearray(path.read_bytes())
    at = t.offset + 5 * t.data.shape[1] + 2 * 20 + 2   # row 5, block 2, its float16 min
    data[at:at + 2] = np.array([np.nan], dtype=np.float16).view(np.uint8).tobytes()
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(SwiftkError, match=r"blk\.2\.ffn_up\.weight has NaN"):
        swiftk.load(str(bad), weights="native", persist=False)


def test_every_method_is_lossless_on_int8_activations(smollm2_path):
    """The default numerical model (int8 activations): every method's greedy output equals autoregressive decoding
    on real weights, drafting every round, trees up to 64 nodes (verify passes of 33-64 tokens run the fused loop
    too) and a user proposer that proposes long wrong chains."""

    class Wrong:
        def propose(self, tokens):
            return [(t * 7 + 3) % 49000 for t in tokens[-40:]]

    eng = swiftk.load("smollm2-135m", persist=False)   # by registry name: the shipped MoA drafter is found
    assert eng.info()["activations"] == "int8"
    skip = eng.states.from_layers(attention=[4, 9, 14, 19, 24], mlp=[6, 12, 18])
    prompts = ["def is_prime(n):\n", "Write a short story about a robot learning to paint.",
               "import numpy as np\n\ndef softmax(x):\n"]
    rounds: dict = {}
    for p in prompts:
        ar = eng.generate(p, max_new_tokens=48, method="autoregressive").token_ids
        runs = {
            "swift": dict(method="swift", speculate="always"),
            "ngram-64": dict(method="ngram", speculate="always", max_tree_nodes=64),
            "early_exit": dict(method="early_exit", exit_layer=12),
            "static": dict(method="static", skip_set=skip, speculate="always"),
            "moa": dict(method="moa", speculate="always"),
            "user": dict(method="ngram", speculate="always", max_tree_nodes=48, proposers=[Wrong()]),
        }
        for name, kw in runs.items():
            out = eng.generate(p, max_new_tokens=48, **kw)
            assert out.token_ids == ar, (name, p)
            rounds[name] = rounds.get(name, 0) + out.stats["rounds"]
    assert all(rounds.values()), rounds   # every method verified drafts (not plain steps only)
