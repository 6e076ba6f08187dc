"""Backend dispatch (swiftk.runtime.ops): defaults, SWIFTK_BACKEND override, errors, describe(), per-op fallback."""
import os

import torch

if not torch.cuda.is_available():
    # kernels decide interpreter mode at import; make any import in this process the interpreted one
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

import swiftk.runtime.ops as ops_mod  # noqa: E402
from swiftk.errors import SwiftkError  # noqa: E402
from swiftk.runtime.ops import OP_NAMES, cuda_ops, cupy_ops, describe, get_ops, reference, triton_ops  # noqa: E402


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("SWIFTK_BACKEND", raising=False)
    ops_mod.clear_cache()
    yield
    ops_mod.clear_cache()


def test_cpu_default_is_torch_and_the_kernel_librarys_ops():
    from swiftk.runtime.ops import cpu_kv, native

    ops = get_ops("cpu")
    kernels = native.library() is not None
    assert ops.name == ("cpu+torch" if kernels else "torch")
    assert describe("cpu") == {name: "cpu" if kernels and name == "kv_commit" else "torch" for name in OP_NAMES}
    for name in OP_NAMES:
        want = cpu_kv.kv_commit if kernels and name == "kv_commit" else getattr(reference, name)
        assert getattr(ops, name) is want


def test_forced_torch(monkeypatch):
    monkeypatch.setenv("SWIFTK_BACKEND", "torch")
    assert set(describe("cpu").values()) == {"torch"}


def test_unknown_backend_value(monkeypatch):
    monkeypatch.setenv("SWIFTK_BACKEND", "metal")
    with pytest.raises(SwiftkError, match="SWIFTK_BACKEND='metal'"):
        get_ops("cpu")


def test_forced_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("SWIFTK_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SwiftkError, match="TRITON_INTERPRET=1"):
        get_ops("cpu")


def test_forced_triton_unavailable(monkeypatch):
    monkeypatch.setenv("SWIFTK_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_ops, "available", lambda: (False, "triton cannot be imported (test)"))
    with pytest.raises(SwiftkError, match="triton cannot be imported"):
        get_ops("cpu")


def test_forced_cuda_on_cpu(monkeypatch):
    monkeypatch.setenv("SWIFTK_BACKEND", "cuda")
    with pytest.raises(SwiftkError, match="CUDA device"):
        get_ops("cpu")


def test_forced_cuda_extension_missing(monkeypatch):
    monkeypatch.setenv("SWIFTK_BACKEND", "cuda")
    monkeypatch.setattr(cuda_ops, "available", lambda: (False, "the CUDA extension swiftk._C is not built"))
    monkeypatch.setattr(triton_ops, "available", lambda: (False, "no triton (test)"))
    with pytest.raises(SwiftkError, match="swiftk._C is not built"):
        get_ops("cuda")


def test_cuda_device_falls_back_per_op(monkeypatch):
    """Extension ops where it has them, triton for the rest; torch when neither is there."""
    fake = {name: (lambda *a, _n=name: _n) for name in cuda_ops.CUDA_OPS}
    monkeypatch.setattr(cuda_ops, "available", lambda: (True, "ok"))
    monkeypatch.setattr(cuda_ops, "make_ops", lambda fallback, ext=None: dict(fake))
    monkeypatch.setattr(triton_ops, "available", lambda: (True, "ok"))
    monkeypatch.setattr(triton_ops, "ops", lambda: {name: (lambda *a: "triton") for name in OP_NAMES})
    got = describe("cuda")
    assert got == {name: ("cuda" if name in cuda_ops.CUDA_OPS else "triton") for name in OP_NAMES}
    assert get_ops("cuda").name == "cuda+triton"
    assert get_ops("cuda").tree_attention() == "tree_attention"

    ops_mod.clear_cache()
    monkeypatch.setattr(triton_ops, "available", lambda: (False, "no triton (test)"))
    got = describe("cuda")
    assert got == {name: ("cuda" if name in cuda_ops.CUDA_OPS else "torch") for name in OP_NAMES}

    ops_mod.clear_cache()
    monkeypatch.setattr(cuda_ops, "available", lambda: (False, "not built (test)"))
    monkeypatch.setattr(cupy_ops, "available", lambda: (False, "no cupy (test)"))
    assert set(describe("cuda").values()) == {"torch"}


def test_cupy_serves_the_cuda_kernels_without_the_extension(monkeypatch):
    """No swiftk._C but CuPy: the same CUDA kernels through NVRTC; forced cupy without CuPy names why."""
    seen = {}

    def fake_make_ops(fallback, ext=None):
        seen["ext"] = ext
        return {name: (lambda *a, _n=name: _n) for name in cuda_ops.CUDA_OPS}

    monkeypatch.setattr(cuda_ops, "available", lambda: (False, "not built (test)"))
    monkeypatch.setattr(cupy_ops, "available", lambda: (True, "ok"))
    monkeypatch.setattr(cuda_ops, "make_ops", fake_make_ops)
    monkeypatch.setattr(triton_ops, "available", lambda: (False, "no triton (test)"))
    got = describe("cuda")
    assert got == {name: ("cupy" if name in cuda_ops.CUDA_OPS else "torch") for name in OP_NAMES}
    assert seen["ext"] is cupy_ops.extension()

    ops_mod.clear_cache()
    monkeypatch.setenv("SWIFTK_BACKEND", "cupy")
    monkeypatch.setattr(cupy_ops, "available", lambda: (False, "cupy cannot be imported (test)"))
    with pytest.raises(SwiftkError, match="SWIFTK_BACKEND=cupy but cupy cannot be imported"):
        get_ops("cuda")
    ops_mod.clear_cache()
    with pytest.raises(SwiftkError, match="cupy needs a CUDA device"):
        get_ops("cpu")


def _inputs():
    g = torch.Generator().manual_seed(0)
    T, H, KV, hd, P, D = 5, 6, 2, 64, 7, 64
    cache = torch.randn(2, 2, KV, P + T + 3, hd, generator=g)
    tree = torch.tril(torch.ones(T, T, dtype=torch.bool))
    tree[3, :3] = False  # token 3 hangs off the root only
    tree[3, 0] = True
    return dict(
        x=torch.randn(T, D, generator=g), d=torch.randn(T, D, generator=g), w=torch.randn(D, generator=g),
        q=torch.randn(T, H, hd, generator=g), cache=cache, P=P, T=T,
        bits=reference.pack_tree_mask(tree), pos=torch.arange(P, P + T),
        inv=1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)),
        gu=torch.randn(T, 2 * 96, generator=g), skip=torch.tensor([True, False]),
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter path")
def test_forced_triton_serves_every_runtime_op(monkeypatch):
    """SWIFTK_BACKEND=triton + TRITON_INTERPRET=1 on CPU: every op the runtime calls runs and matches torch."""
    pytest.importorskip("triton")
    monkeypatch.setenv("SWIFTK_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = get_ops("cpu")
    assert ops.name == "triton" and describe("cpu") == {name: "triton" for name in OP_NAMES}
    a, r = _inputs(), reference
    ok = lambda u, v: torch.allclose(u, v, atol=1e-4, rtol=1e-4)  # noqa: E731
    assert ok(ops.rmsnorm(a["x"], a["w"], 1e-6), r.rmsnorm(a["x"], a["w"], 1e-6))
    for flag in (None, a["skip"][0], a["skip"][1]):
        got, want = ops.fused_add_rmsnorm(a["d"], a["x"], a["w"], 1e-6, flag), \
            r.fused_add_rmsnorm(a["d"], a["x"], a["w"], 1e-6, flag)
        assert ok(got[0], want[0]) and ok(got[1], want[1])
    assert ok(ops.apply_rope(a["q"], a["pos"], a["inv"]), r.apply_rope(a["q"], a["pos"], a["inv"]))
    assert ok(ops.apply_rope(a["q"], a["pos"], a["inv"].float()), r.apply_rope(a["q"], a["pos"], a["inv"].float()))
    assert ok(ops.swiglu(a["gu"]), r.swiglu(a["gu"]))
    S = a["P"] + a["T"]
    k, v = a["cache"][1, 0, :, :S], a["cache"][1, 1, :, :S]
    scale = 1 / math.sqrt(64)
    assert ok(ops.tree_attention(a["q"], k, v, a["P"], a["bits"], scale),
              r.tree_attention(a["q"], k, v, a["P"], a["bits"], scale))
    mask = torch.ones(a["T"], S, dtype=torch.bool)
    mask[:, -2:] = False
    assert ok(ops.attention(a["q"], k, v, mask, scale), r.attention(a["q"], k, v, mask, scale))
    c1, c2 = a["cache"].clone(), a["cache"].clone()
    src, dst = torch.tensor([7, 9, 10]), torch.tensor([7, 8, 9])
    ops.kv_commit(c1, src, dst)
    r.kv_commit(c2, src, dst)
    assert torch.equal(c1, c2)


def test_get_ops_is_cached_per_setting(monkeypatch):
    a = get_ops("cpu")
    assert get_ops("cpu") is a
    monkeypatch.setenv("SWIFTK_BACKEND", "torch")
    assert get_ops("cpu") is not a  # the env value is part of the key
