"""kernels/cpu/cpu_quant.cpp: dequantization bit for bit gguf.quants.dequantize's, the block-quant matmul against torch
on the dequantized weight, batch invariance, and bad operands raising SwiftkError."""
import ctypes
import os

import numpy as np
import pytest
import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.ops import cpu_quant

gguf = pytest.importorskip("gguf")
import gguf.quants as gq  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason=f"CPU quant kernel: {cpu_quant.status()}")

NAMES = list(cpu_quant.TYPES)
# byte offsets of each format's float16 fields (scales, mins), which random bytes would fill with inf/NaN
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,)}


def _blocks(name: str, rows: int, K: int, seed: int) -> np.ndarray:
    """[rows, bytes per row] uint8: gguf's own quantization of random rows where the package can quantize the type,
    then as many rows of random blocks whose float16 fields are finite (normal, subnormal, zero, negative)."""
    t = Q[name]
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    parts = []
    try:
        parts.append(gq.quantize(rng.standard_normal((rows, K)).astype(np.float32), t))
    except NotImplementedError:
        pass
    raw = rng.integers(0, 256, (rows, K // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        v = rng.uniform(1e-3, 5e-2, raw.shape[:2]) * rng.choice([-1.0, 1.0], raw.shape[:2])
        v[rng.random(raw.shape[:2]) < 0.1] = 3e-6   # float16 subnormal
        v[rng.random(raw.shape[:2]) < 0.05] = 0.0
        raw[:, :, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    parts.append(raw.reshape(rows, -1))
    return np.ascontiguousarray(np.concatenate(parts))


def _k(name: str) -> int:
    # several blocks; for 32-element blocks also a partial 256-element span (the M > 4 path's decode unit)
    return 768 if gguf.GGML_QUANT_SIZES[Q[name]][0] == 256 else 288


def check_dequant(dequant, name: str) -> None:
    K = _k(name)
    raw = _blocks(name, 12, K, seed=len(name) * 7 + K)
    want = gq.dequantize(raw, Q[name]).astype(np.float32).reshape(-1)
    got = dequant(Q[name], torch.from_numpy(raw), want.size).numpy()
    assert got.dtype == np.float32 and got.shape == want.shape
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{name}: {bad.size} elements differ, first at {bad[0]}: {got[bad[0]]} vs {want[bad[0]]}"


def check_linear(linear, name: str, Ms=(1, 3, 17)) -> None:
    K = _k(name)
    raw = _blocks(name, 20, K, seed=len(name) + 3 * K)   # 40 or 20 rows: not a multiple of the row blocks (4, 8)
    W = torch.from_numpy(gq.dequantize(raw, Q[name]).astype(np.float32)).double()
    g = torch.Generator().manual_seed(K)
    x = torch.randn(max(Ms), K, generator=g)
    w = torch.from_numpy(raw)
    full = linear(x, w, Q[name], K)
    for M in Ms:
        got = linear(x[:M], w, Q[name], K)
        assert got.shape == (M, raw.shape[0]) and got.dtype == torch.float32
        want = x[:M].double() @ W.T
        # float32 summation bound: (K / 8 lanes + 16 reduction steps) roundings of the sum of |terms|, x2
        tol = (K / 8 + 16) * 2.0 ** -23 * (x[:M].double().abs() @ W.abs().T) + 1e-30
        err = (got.double() - want).abs()
        assert bool((err <= tol).all()), f"{name} M={M}: max error {err.max():.3g}, over tolerance"
        # batch invariance: a row's result does not depend on how many rows share the call
        assert torch.equal(got, full[:M]), f"{name}: M={M} differs from the same rows within M={max(Ms)}"


@pytest.mark.parametrize("name", NAMES)
def test_sizes_match_gguf(name):
    assert (cpu_quant.block_size(Q[name]), cpu_quant.type_size(Q[name])) == gguf.GGML_QUANT_SIZES[Q[name]]


@pytest.mark.parametrize("name", NAMES)
def test_dequant_bit_exact(name):
    check_dequant(cpu_quant.dequant, name)


@pytest.mark.parametrize("name", NAMES)
def test_linear_equals_torch_and_batch_invariant(name):
    check_linear(cpu_quant.linear, name, Ms=(1, 2, 3, 4, 5, 17))


@pytest.mark.parametrize("name,M", [("Q4_K", 11), ("Q4_K", 70), ("Q6_K", 70)])
def test_rows_alone_equal_rows_together(name, M):
    """Also past 64 rows, where the span path (Q6_K) or the 4-row tiles (Q4_K on AVX-512) take the rows in passes."""
    raw = _blocks(name, 9, 512, seed=M)
    x = torch.randn(M, 512, generator=torch.Generator().manual_seed(M))
    w = torch.from_numpy(raw)
    full = cpu_quant.linear(x, w, Q[name], 512)
    W = torch.from_numpy(gq.dequantize(raw, Q[name]).astype(np.float32)).double()
    tol = (512 / 8 + 16) * 2.0 ** -23 * (x.double().abs() @ W.abs().T)
    assert bool(((full.double() - x.double() @ W.T).abs() <= tol).all())
    for m in range(M):
        assert torch.equal(cpu_quant.linear(x[m:m + 1], w, Q[name], 512)[0], full[m])


def test_bad_operands_raise():
    raw = torch.from_numpy(_blocks("Q4_0", 4, 64, seed=2))   # [8, 36]
    x = torch.randn(2, 64)
    with pytest.raises(SwiftkError, match="unsupported ggml type"):
        cpu_quant.linear(x, raw, 99, 64)
    with pytest.raises(SwiftkError, match="unsupported ggml type"):
        cpu_quant.dequant(Q.F16, raw, 64)
    with pytest.raises(SwiftkError, match="block size"):
        cpu_quant.linear(torch.randn(2, 48), raw, Q.Q4_0, 48)
    with pytest.raises(SwiftkError, match="needs shape"):   # truncated rows
        cpu_quant.linear(x, raw[:, :-1].contiguous(), Q.Q4_0, 64)
    with pytest.raises(SwiftkError, match="needs shape"):   # bytes of another format
        cpu_quant.linear(x, raw, Q.Q8_0, 64)
    with pytest.raises(SwiftkError, match="needs shape"):
        cpu_quant.linear(x, raw.reshape(-1), Q.Q4_0, 64)
    with pytest.raises(SwiftkError, match="uint8"):
        cpu_quant.linear(x, raw.view(torch.int8), Q.Q4_0, 64)
    with pytest.raises(SwiftkError, match="contiguous"):
        cpu_quant.linear(x, torch.cat([raw, raw], 1)[:, :36], Q.Q4_0, 64)
    with pytest.raises(SwiftkError, match="x must be"):
        cpu_quant.linear(torch.randn(2, 32), raw, Q.Q4_0, 64)
    with pytest.raises(SwiftkError, match="x must be"):
        cpu_quant.linear(torch.ones(2, 64, dtype=torch.int32), raw, Q.Q4_0, 64)
    with pytest.raises(SwiftkError, match="take 36 bytes"):
        cpu_quant.dequant(Q.Q4_0, raw.reshape(-1)[:-1], 64)
    with pytest.raises(SwiftkError, match="block size"):
        cpu_quant.dequant(Q.Q4_0, raw, 48)


@pytest.mark.skipif(os.environ.get("SWIFTK_TEST_QUANT_ISAS") != "1",
                    reason="set SWIFTK_TEST_QUANT_ISAS=1 to also build and check the AVX2 and portable paths (~25 s)")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_other_paths(tmp_path, march):
    """The paths this host's -march=native build does not take: AVX2+FMA (haswell) and portable C++ (x86-64)."""
    from swiftk.runtime.ops import native_build

    cxx = native_build.compiler()
    if cxx is None or native_build.cmake() is None:
        pytest.skip("no C++ compiler or cmake")
    so = tmp_path / f"cpu_quant_{march}.so"
    folder = native_build.source_path("CMakeLists.txt").parent
    units = sorted(p.name for p in [*folder.glob("cpu_quant*.cpp"), *folder.glob("cpu_qdot*.cpp")]) + ["cpu_pool.cpp"]
    native_build.build_library(so, cxx, "portable", f"-O3 -march={march}", units)
    lib = ctypes.CDLL(str(so))
    assert lib.swk_q_isa() == (256 if march == "haswell" else 0)
    lib.swk_q_dequant.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.swk_q_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_int64, ctypes.c_void_p]

    def dequant(t, raw, n):
        out = torch.empty(n, dtype=torch.float32)
        assert lib.swk_q_dequant(int(t), raw.data_ptr(), n, out.data_ptr()) == 0
        return out

    def linear(x, w, t, K):
        x = x.contiguous()
        y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        assert lib.swk_q_linear(x.data_ptr(), x.shape[0], K, w.data_ptr(), int(t), w.shape[0], y.data_ptr()) == 0
        return y

    for name in NAMES:
        check_dequant(dequant, name)
        check_linear(linear, name, Ms=(1, 2, 3, 5, 17))
