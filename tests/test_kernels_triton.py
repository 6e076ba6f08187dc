"""Triton kernels vs their torch reference twins (swiftk.runtime.ops.reference).

Runs on CPU under the Triton interpreter (TRITON_INTERPRET=1, set here before any kernel import when no GPU is
present), with small random shapes. Tolerance per element: |kernel - reference| <= tol * scale * (1 + |reference|) with tol
fp32 1e-4, fp16 5e-3, bf16 3e-2 and a per-test scale of 1-8 for ops with more rounding steps. The reference rounds
through the same dtype, so the gap is summation order plus a rounding step or two (the interpreter also rounds
fp32 -> bf16 toward zero, not to nearest, which costs up to one more bf16 ulp).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no GPU and TRITON_INTERPRET is off", allow_module_level=True)

from swiftk.runtime.config import RopeScaling, rope_inv_freq  # noqa: E402
from swiftk.errors import SwiftkError  # noqa: E402
from swiftk.runtime.ops import reference as R  # noqa: E402
from swiftk.runtime.ops.triton_ops import ops as triton_ops  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OPS = triton_ops()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def close(a, b, dtype, scale=1.0):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    if not a.numel():
        return
    a, b = a.float(), b.float()
    ratio = ((a - b).abs() / (1 + b.abs())).max().item()
    assert ratio <= TOL[dtype] * scale, f"max |a-b|/(1+|b|) = {ratio} > {TOL[dtype] * scale} ({dtype})"


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


# ---------------------------------------------------------------- RMSNorm / residual


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_rmsnorm(dtype, seed):
    g = gen(seed)
    T = int(torch.randint(1, 9, (1,), generator=g))
    D = [64, 96, 130][seed]
    x, w = randn(g, T, D, dtype=dtype), randn(g, D, dtype=dtype)
    close(OPS["rmsnorm"](x, w, 1e-5), R.rmsnorm(x, w, 1e-5), dtype, scale=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_fused_add_rmsnorm_skip_flags(dtype, seed):
    """One launch sequence over a random skip set: skipped sublayers pass the residual through."""
    g = gen(100 + seed)
    n_layers, T, D = 4, int(torch.randint(1, 6, (1,), generator=g)), [64, 160, 96][seed]
    skip = (torch.rand(2 * n_layers, generator=g) < 0.5).to(DEV)
    skip[0] = skip[1] = skip[-1] = skip[-2] = False
    w = randn(g, D, dtype=dtype)
    res = randn(g, T, D, dtype=dtype)
    for i in range(2 * n_layers):
        delta = randn(g, T, D, dtype=dtype)
        # each step starts from the kernel's previous residual, so rounding differences do not accumulate
        nk, rk = OPS["fused_add_rmsnorm"](delta, res, w, 1e-6, skip[i])  # 0-dim view of the skip set
        nr, rr = R.fused_add_rmsnorm(delta, res, w, 1e-6, skip[i])
        close(rk, rr, dtype)
        close(nk, nr, dtype, scale=4)
        if bool(skip[i]):
            assert torch.equal(rk, res)
        res = rk
    nk, rk = OPS["fused_add_rmsnorm"](delta, res, w, 1e-6)  # no flag
    nr, rr = R.fused_add_rmsnorm(delta, res, w, 1e-6)
    close(rk, rr, dtype)
    close(nk, nr, dtype, scale=4)


def test_fused_add_rmsnorm_flag_is_read_on_device():
    """Flipping the flag tensor's content (not the Python argument) changes the result."""
    g = gen(7)
    x, d, w = randn(g, 3, 64), randn(g, 3, 64), randn(g, 64)
    flag = torch.zeros((), dtype=torch.bool, device=DEV)
    _, r0 = OPS["fused_add_rmsnorm"](d, x, w, 1e-6, flag)
    flag.fill_(True)
    _, r1 = OPS["fused_add_rmsnorm"](d, x, w, 1e-6, flag)
    assert torch.allclose(r0, x + d) and torch.equal(r1, x)


# ---------------------------------------------------------------- RoPE


def _inv_freq(hd, scaled, dtype):
    cfg = SimpleNamespace(head_dim=hd, rope_theta=500000.0 if scaled else 10000.0, rope_freq_factors=None,
                          rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192) if scaled else None)
    return rope_inv_freq(cfg).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd,H,scaled,inv_dtype", [(64, 9, False, torch.float64), (128, 3, True, torch.float64),
                                                   (96, 4, True, torch.float32), (80, 5, False, torch.float32)])
def test_apply_rope(dtype, hd, H, scaled, inv_dtype):
    g = gen(hd + H)
    T = int(torch.randint(1, 12, (1,), generator=g))
    x = randn(g, T, H, hd, dtype=dtype)
    pos = torch.randint(0, 100_000, (T,), generator=g).to(DEV)
    inv = _inv_freq(hd, scaled, inv_dtype)
    close(OPS["apply_rope"](x, pos, inv), R.apply_rope(x, pos, inv), dtype, scale=2)


def test_apply_rope_on_fused_qkv_view():
    """q and k heads of a fused qkv projection rotate in one call, read through a strided view (the runtime
    never rotated in place, so the ``out=`` path was removed)."""
    g = gen(11)
    T, H, KV, hd = 5, 6, 2, 64
    qkv = randn(g, T, (H + 2 * KV) * hd)
    qk = qkv[:, : (H + KV) * hd].view(T, H + KV, hd)
    pos = torch.arange(10, 10 + T, device=DEV)
    inv = _inv_freq(hd, False, torch.float64)
    want = R.apply_rope(qk.clone(), pos, inv)
    v_before = qkv[:, (H + KV) * hd:].clone()
    got = OPS["apply_rope"](qk, pos, inv)
    close(got, want, torch.float32)
    assert torch.equal(qkv[:, (H + KV) * hd:], v_before)


def test_apply_rope_rejects_odd_head_dim():
    with pytest.raises(SwiftkError, match="even"):
        OPS["apply_rope"](torch.zeros(2, 1, 7, device=DEV), torch.zeros(2, dtype=torch.long, device=DEV),
                          torch.ones(3, dtype=torch.float64, device=DEV))


# ---------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("I", [64, 100, 1536])
def test_swiglu(dtype, I):
    g = gen(I)
    gu = randn(g, int(torch.randint(1, 7, (1,), generator=g)), 2 * I, dtype=dtype) * 3
    close(OPS["swiglu"](gu), R.swiglu(gu), dtype, scale=8)


# ---------------------------------------------------------------- attention


def random_tree_mask(T, g):
    """Random parent array (parent index < own index) -> dense ancestor mask incl. self."""
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        m[i, i] = True
        if i:
            p = int(torch.randint(0, i, (1,), generator=g))
            m[i] |= m[p]
    return m


def make_cache(g, L, KV, S, hd, dtype):
    return randn(g, L, 2, KV, S, hd, dtype=dtype)


ATTN_CASES = [  # T, H, KV, hd, prefix_len
    (1, 9, 3, 64, 37),     # decode, GQA 3
    (5, 3, 3, 128, 0),     # no prefix, MHA, 3 heads
    (33, 4, 1, 64, 20),    # two mask words, MQA
    (70, 9, 3, 64, 65),    # three mask words
    (12, 6, 2, 80, 9),     # non-power-of-two head_dim
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,KV,hd,P", ATTN_CASES)
def test_tree_attention(dtype, T, H, KV, hd, P):
    g = gen(T * 1000 + hd + P)
    S_max = P + T + 7
    cache = make_cache(g, 2, KV, S_max, hd, dtype)
    k, v = cache[1, 0, :, : P + T], cache[1, 1, :, : P + T]  # strided views of the big cache, not copied
    q = randn(g, T, H, hd, dtype=dtype)
    bits = R.pack_tree_mask(random_tree_mask(T, g)).to(DEV)
    scale = 1 / math.sqrt(hd)
    close(OPS["tree_attention"](q, k, v, P, bits, scale), R.tree_attention(q, k, v, P, bits, scale), dtype, scale=2)


def test_tree_attention_causal_chain_matches_dense():
    g = gen(5)
    T, P, H, KV, hd = 40, 3, 4, 2, 64
    cache = make_cache(g, 1, KV, 64, hd, torch.float32)
    k, v = cache[0, 0, :, : P + T], cache[0, 1, :, : P + T]
    q = randn(g, T, H, hd)
    bits = R.pack_tree_mask(torch.tril(torch.ones(T, T, dtype=torch.bool))).to(DEV)
    mask = torch.ones(T, P + T, dtype=torch.bool, device=DEV)
    mask[:, P:] = torch.tril(mask[:, P:])
    out = OPS["tree_attention"](q, k, v, P, bits, 0.125)
    close(out, R.attention(q, k, v, mask, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,S,H,KV,hd", [(1, 50, 3, 3, 64), (7, 90, 9, 3, 128), (20, 33, 4, 2, 80)])
def test_dense_attention(dtype, T, S, H, KV, hd):
    g = gen(T + S)
    cache = make_cache(g, 1, KV, S + 5, hd, dtype)
    k, v = cache[0, 0, :, :S], cache[0, 1, :, :S]
    q = randn(g, T, H, hd, dtype=dtype)
    mask = (torch.rand(T, S, generator=g) < 0.4).to(DEV)
    mask[:, 0] = True
    close(OPS["attention"](q, k, v, mask, 0.1), R.attention(q, k, v, mask, 0.1), dtype, scale=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_attention_stops_at_the_device_limit(dtype):
    """A mask over the whole cache with a device-side key bound (what a CUDA graph passes): keys from the bound on
    are never read, so garbage there changes nothing; a bound below the visible slots does change the result."""
    g = gen(11)
    T, S, live, H, KV, hd = 4, 300, 150, 9, 3, 64
    cache = make_cache(g, 1, KV, S, hd, dtype)
    k, v = cache[0, 0], cache[0, 1]
    q = randn(g, T, H, hd, dtype=dtype)
    mask = torch.zeros(T, S, dtype=torch.bool, device=DEV)
    mask[:, :live] = torch.rand(T, live, generator=g).to(DEV) < 0.7
    mask[:, 0] = True
    ref = R.attention(q, k[:, :live], v[:, :live], mask[:, :live], 0.1)
    k[:, live:], v[:, live:] = float("nan"), float("nan")   # past the bound: must not be read
    limit = torch.tensor([live], device=DEV)
    close(OPS["attention"](q, k, v, mask, 0.1, limit=limit), ref, dtype, scale=2)
    short = OPS["attention"](q, k, v, mask, 0.1, limit=torch.tensor([live // 2], device=DEV))
    assert short.isfinite().all() and not torch.allclose(short.float(), ref.float(), atol=1e-2)
    with pytest.raises(SwiftkError, match="limit must be one int"):
        OPS["attention"](q, k, v, mask, 0.1, limit=torch.tensor([1.0, 2.0], device=DEV))


def test_attention_limits():
    q = torch.zeros(2, 3, 512, device=DEV)
    kv = torch.zeros(1, 4, 512, device=DEV)
    bits = torch.ones(2, 1, dtype=torch.int32, device=DEV)
    with pytest.raises(SwiftkError, match="head_dim 512"):
        OPS["tree_attention"](q, kv, kv, 2, bits, 1.0)
    with pytest.raises(SwiftkError, match="multiple"):
        OPS["tree_attention"](torch.zeros(2, 3, 64, device=DEV), torch.zeros(2, 4, 64, device=DEV),
                              torch.zeros(2, 4, 64, device=DEV), 2, bits, 1.0)
    with pytest.raises(SwiftkError, match="slots"):
        OPS["tree_attention"](torch.zeros(2, 2, 64, device=DEV), torch.zeros(1, 3, 64, device=DEV),
                              torch.zeros(1, 3, 64, device=DEV), 2, bits, 1.0)


# ---------------------------------------------------------------- KV commit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_kv_commit_random_paths(dtype, seed):
    """Accepted tree path (increasing slots past the prefix) -> contiguous slots; ranges overlap."""
    g = gen(300 + seed)
    L, KV, hd, P, n_tree = 3, [1, 3, 2, 3][seed], [64, 128, 80, 64][seed], 10, 30
    cache = make_cache(g, L, KV, P + n_tree + 4, hd, dtype)
    n = int(torch.randint(1, 12, (1,), generator=g))
    path = torch.sort(torch.randperm(n_tree, generator=g)[:n]).values + P
    path[0] = P  # the root is the first new slot
    src, dst = path.to(DEV), torch.arange(P, P + n, device=DEV)
    want = cache.clone()
    R.kv_commit(want, src, dst)
    OPS["kv_commit"](cache, src, dst)
    assert torch.equal(cache, want)


def test_kv_commit_permuted_overlap():
    """src and dst are the same slots in another order: every read must see the old values."""
    g = gen(9)
    cache = make_cache(g, 2, 2, 20, 64, torch.float32)
    src = torch.tensor([7, 3, 5, 4, 6], device=DEV)
    dst = torch.tensor([3, 4, 5, 6, 7], device=DEV)
    want = cache.clone()
    R.kv_commit(want, src, dst)
    OPS["kv_commit"](cache, src, dst.to(torch.int32))
    assert torch.equal(cache, want)


def test_kv_commit_many_slots_chunked_columns():
    """More slots than fit one column chunk: the kernel loops over head_dim chunks (still one launch)."""
    g = gen(10)
    n, hd = 200, 128
    cache = make_cache(g, 1, 1, 2 * n + 3, hd, torch.float32)
    src = torch.arange(2, 2 * n + 2, 2, device=DEV)  # every other slot, overlapping dst
    dst = torch.arange(1, n + 1, device=DEV)
    want = cache.clone()
    R.kv_commit(want, src, dst)
    OPS["kv_commit"](cache, src, dst)
    assert torch.equal(cache, want)
