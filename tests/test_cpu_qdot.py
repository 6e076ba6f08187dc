"""kernels/cpu/cpu_qdot.cpp, the int8-activation block matmul: the activation quantizer (SIMD and scalar equal, and equal
to a numpy definition), the kernel against a numpy reference and bit for bit against its scalar definition, batch
invariance (rows, their positions, tiles, threads, column slices), every ISA build agreeing bit for bit, bad
operands."""
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.ops import cpu_quant
from test_cpu_quant import NAMES, _blocks

gguf = pytest.importorskip("gguf")
import gguf.quants as gq  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason=f"CPU quant kernel: {cpu_quant.status()}")


def _k(name: str) -> int:
    return 768 if gguf.GGML_QUANT_SIZES[Q[name]][0] == 256 else 288


def np_quantize(x: np.ndarray, bs: int = 32):
    """The definition in numpy: per block of 32 d = amax / 127 and q = round_half_even(x * (127 / amax)), float32."""
    M, K = x.shape
    xb = x.reshape(M, K // bs, bs).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv).astype(np.int8).reshape(M, K)
    return q, (amax[..., 0] / np.float32(127)).astype(np.float32)


def _activations(M: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 3
    x[0, :16] = 0.0                              # a block that is (partly) zero
    if M > 2:
        x[2, 5] = 40.0                           # an outlier: every other element of its block rounds near 0
        x[1, :32] = torch.arange(32) - 15.5      # exact halves: ties round to even
    return x


def test_quantizer_simd_equals_scalar_and_numpy():
    x = _activations(7, 1024, seed=3)
    q, d = cpu_quant.quantize(x)
    qs, ds = cpu_quant.quantize(x, simd=False)
    assert torch.equal(q, qs) and torch.equal(d.view(torch.int32), ds.view(torch.int32))
    nq, nd = np_quantize(x.numpy())
    assert np.array_equal(q.numpy(), nq) and np.array_equal(d.numpy().view(np.uint32), nd.view(np.uint32))
    assert int(q.abs().max()) == 127 and int(q[0, :16].abs().max()) == 0


def test_quantizer_marks_non_finite_blocks():
    x = torch.randn(2, 64)
    x[0, 3], x[1, 40] = float("inf"), float("nan")
    for simd in (True, False):
        q, d = cpu_quant.quantize(x, simd=simd)
        assert torch.isnan(d[0, 0]) and torch.isnan(d[1, 1]) and torch.isfinite(d[0, 1]) and torch.isfinite(d[1, 0])
        assert int(q[0, :32].abs().max()) == 0


def _reference(x: torch.Tensor, raw: np.ndarray, name: str):
    """(y, tolerance) in float64: the dequantized weights times the dequantized activations; the tolerance covers
    the kernel's float32 epilogue (a few roundings per block)."""
    K = x.shape[1]
    q, d = np_quantize(x.numpy())
    xd = q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
    W = gq.dequantize(raw, Q[name]).astype(np.float64)
    tol = (K / 32 * 2 + 8) * 2.0 ** -22 * (np.abs(xd) @ np.abs(W).T) + 1e-30
    return xd @ W.T, tol


@pytest.mark.parametrize("name", NAMES)
def test_kernel_equals_numpy_and_its_scalar_definition(name):
    K = _k(name)
    raw = _blocks(name, 21, K, seed=len(name) + K)   # 21 or 42 rows: a short last group of 8
    x = _activations(13, K, seed=K)
    w = torch.from_numpy(raw)
    got = cpu_quant.linear(x, w, Q[name], K, act="int8")
    ref = cpu_quant.linear(x, w, Q[name], K, act="int8", reference=True)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), f"{name}: SIMD path differs from the definition"
    want, tol = _reference(x, raw, name)
    err = np.abs(got.numpy().astype(np.float64) - want)
    assert (err <= tol).all(), f"{name}: max error {err.max():.3g} over tolerance (max {tol.max():.3g})"
    # int8 activations are a different numerical model from float32 activations, close to it
    flt = cpu_quant.linear(x, w, Q[name], K).double()
    assert float((got.double() - flt).abs().max() / flt.abs().max()) < 0.05


@pytest.mark.parametrize("name", NAMES)
def test_batch_invariance(name):
    """A row's output is the same bits whatever M (1..33), its position in the pass (so its 4-row tile and lane), the
    thread count and whether its weight rows are a column slice of a wider output."""
    K = _k(name)
    raw = _blocks(name, 19, K, seed=3 * K + len(name))
    w = torch.from_numpy(raw)
    x = _activations(33, K, seed=K + 1)
    full = cpu_quant.linear(x, w, Q[name], K, act="int8")
    for M in range(1, 34):
        assert torch.equal(cpu_quant.linear(x[:M], w, Q[name], K, act="int8"), full[:M]), f"{name}: M={M}"
    perm = torch.randperm(33, generator=torch.Generator().manual_seed(1))
    assert torch.equal(cpu_quant.linear(x[perm], w, Q[name], K, act="int8"), full[perm])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_quant.linear(x, w, Q[name], K, act="int8"), full)
    finally:
        torch.set_num_threads(threads)
    # the same rows as the second part of a stacked matrix (a column slice of y)
    other = torch.from_numpy(_blocks(name, 5, K, seed=9))
    parts = tuple((cpu_quant.repack(r, Q[name], K), Q[name]) for r in (other, w))
    both = cpu_quant.linear_parts(x, parts, K, "int8")
    assert torch.equal(both[:, other.shape[0]:], full)


@pytest.mark.parametrize("name", NAMES)
def test_threaded_passes_equal_the_definition(name):
    """Matrices big enough that OpenMP splits the weight rows over threads (N * K >= 65536): every pass size of
    every path (a decode step, the small passes' direct products, the tiles) gives the definition's bits, with the
    default threads and one."""
    K = 3 * _k(name)
    raw = _blocks(name, 83, K, seed=K + 7)   # 10 full groups of 8 and a short one
    w = torch.from_numpy(raw)
    x = _activations(40, K, seed=K + 2)
    ref = cpu_quant.linear(x, w, Q[name], K, act="int8", reference=True)
    threads = torch.get_num_threads()
    try:
        for n in sorted({threads, 1}, reverse=True):
            torch.set_num_threads(n)
            for M in (1, 2, 3, 4, 5, 6, 8, 15, 16, 17, 40):
                got = cpu_quant.linear(x[:M], w, Q[name], K, act="int8")
                assert torch.equal(got.view(torch.int32), ref[:M].view(torch.int32)), f"{name} M={M} threads={n}"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", NAMES)
def test_long_rows_equal_the_definition(name):
    """Rows of hundreds of blocks (a large model's down projection, K = 12800) on every path: each block's scales
    are used within that block, so nothing is kept per block of the row (the direct paths once wrote them at the
    block's index into an array of 8, past its end from 66 blocks on: a segfault at K = 12800)."""
    K = 400 * 32 if gguf.GGML_QUANT_SIZES[Q[name]][0] == 32 else 50 * 256
    raw = torch.from_numpy(_blocks(name, 16, K, seed=11))
    x = _activations(20, K, seed=12)
    ref = cpu_quant.linear(x, raw, Q[name], K, act="int8", reference=True)
    for M in (1, 3, 8, 20):
        got = cpu_quant.linear(x[:M], raw, Q[name], K, act="int8")
        assert torch.equal(got.view(torch.int32), ref[:M].view(torch.int32)), f"{name} M={M}"


@pytest.mark.parametrize("name", NAMES)
def test_repack_round_trip(name):
    """Packing permutes the file's bytes (groups of 8 rows; the rows past the last full group stay as they are);
    unpacking any rows gives them back, and the kernel on the packed matrix equals the definition on the file's."""
    K = _k(name)
    for rows in (8, 21):
        raw = torch.from_numpy(np.ascontiguousarray(_blocks(name, rows, K, seed=rows)))
        packed = cpu_quant.repack(raw, Q[name], K)
        assert packed.shape == raw.shape and not torch.equal(packed, raw)
        assert torch.equal(torch.sort(packed.reshape(-1)).values, torch.sort(raw.reshape(-1)).values)
        ids = torch.randperm(raw.shape[0], generator=torch.Generator().manual_seed(rows))
        assert torch.equal(cpu_quant.unpack_rows(packed, Q[name], K, ids), raw[ids])
        x = _activations(5, K, seed=rows)
        got = cpu_quant.linear(x, packed, Q[name], K, act="int8", packed=True)
        want = cpu_quant.linear(x, raw, Q[name], K, act="int8", reference=True)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_prefill_sized_passes_use_the_same_kernel():
    """No separate GEMM path: a row of a 300-row pass equals the same row alone (both arms share a prefill, but a
    verify pass must equal a plain step, and one kernel for every M makes both true)."""
    name, K = "Q4_K", 512
    raw = torch.from_numpy(_blocks(name, 16, K, seed=5))
    x = _activations(300, K, seed=6)
    full = cpu_quant.linear_parts(x, ((cpu_quant.repack(raw, Q[name], K), Q[name]),), K, "int8")
    for m in (0, 150, 299):
        assert torch.equal(cpu_quant.linear(x[m:m + 1], raw, Q[name], K, act="int8")[0], full[m])


def test_bad_operands_raise():
    raw = torch.from_numpy(_blocks("Q4_0", 4, 64, seed=2))
    x = torch.randn(2, 64)
    with pytest.raises(SwiftkError, match="act="):
        cpu_quant.linear(x, raw, Q.Q4_0, 64, act="int4")
    with pytest.raises(SwiftkError, match="needs shape"):
        cpu_quant.linear(x, raw[:, :-1].contiguous(), Q.Q4_0, 64, act="int8")
    with pytest.raises(SwiftkError, match="x must be"):
        cpu_quant.linear(torch.randn(2, 32), raw, Q.Q4_0, 64, act="int8")
    with pytest.raises(SwiftkError, match="quantize needs"):
        cpu_quant.quantize(torch.randn(2, 48))


# ---- the other ISA paths -------------------------------------------------------------------------------------------
def _build(tmp_path, march):
    """The int8 kernels' units alone, built by kernels/cpu/CMakeLists.txt with ``-march=march``."""
    from swiftk.runtime.ops import native_build

    cxx = native_build.compiler()
    if cxx is None or native_build.cmake() is None:
        pytest.skip("no C++ compiler or cmake")
    so = tmp_path / f"cpu_qdot_{march}.so"
    folder = native_build.source_path("CMakeLists.txt").parent
    units = sorted(p.name for p in folder.glob("cpu_qdot*.cpp")) + ["cpu_pool.cpp"]
    try:
        native_build.build_library(so, cxx, "portable", f"-O3 -march={march}", units)
    except RuntimeError as e:
        if "unknown" in str(e) and march in str(e):
            pytest.skip(f"this compiler does not know -march={march}")
        raise
    return so


def _cpu_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@pytest.mark.parametrize("march,isa,flag", [("haswell", 1, "avx2"), ("x86-64", 0, None),
                                            ("alderlake", 2, "avx_vnni"), ("icelake-server", 3, "avx512_vnni")])
def test_other_isa_paths_agree_bit_for_bit(tmp_path, march, isa, flag):
    """AVX2 without VNNI (haswell), portable C++ (x86-64), 256-bit AVX-VNNI (alderlake) and AVX-512 VNNI's 512-bit
    pairs of rows (icelake-server) compute the same integers and the same float ops as this host's build: identical
    bits, every format (each where this CPU can run it)."""
    if flag and flag not in _cpu_flags():
        pytest.skip(f"this CPU lacks {flag}")
    lib = ctypes.CDLL(str(_build(tmp_path, march)))
    assert lib.swk_qi_isa() == isa
    fn = lib.swk_qi_linear_ld
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int64]
    lib.swk_qi_repack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    for name in NAMES:
        K = _k(name)
        raw = torch.from_numpy(_blocks(name, 13, K, seed=K))
        N = raw.shape[0]
        packed = torch.empty_like(raw)
        assert lib.swk_qi_repack(int(Q[name]), raw.data_ptr(), N, K, packed.data_ptr()) == 0
        assert torch.equal(packed, cpu_quant.repack(raw, Q[name], K))
        for M in (1, 2, 9, 17, 65):   # a decode step's path, the small passes', long passes' (8-pair chunks, tiles)
            x = _activations(M, K, seed=K + M)
            y = torch.empty(M, N)
            assert fn(x.data_ptr(), M, K, packed.data_ptr(), int(Q[name]), N, y.data_ptr(), N) == 0
            want = cpu_quant.linear(x, raw, Q[name], K, act="int8")
            assert torch.equal(y.view(torch.int32), want.view(torch.int32)), f"{name} M={M} on -march={march}"


@pytest.mark.parametrize("march", ["icelake-server", "alderlake"])
def test_vnni_paths_build(tmp_path, march):
    """The VNNI paths (AVX-512 VNNI with VL; AVX-VNNI) compile and take vpdpbusd. This machine may not run them;
    they compute the same integers by construction (no intermediate can saturate), which the ISA test above checks
    wherever such a CPU runs the suite."""
    so = _build(tmp_path, march)
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to look into the build")
    text = subprocess.run([objdump, "-d", str(so)], capture_output=True, text=True, timeout=120).stdout
    assert "vpdpbusd" in text


_OOM_SCRIPT = r"""
import resource, sys
import numpy as np, torch
from swiftk.errors import SwiftkError
from swiftk.runtime.ops import cpu_quant
from gguf import GGMLQuantizationType as Q
import gguf.quants as gq

rng = np.random.default_rng(0)
small = torch.from_numpy(rng.standard_normal((3, 4096)).astype(np.float32))
q8 = torch.from_numpy(gq.quantize(rng.standard_normal((8, 4096)).astype(np.float32), Q.Q8_0))
q4k = torch.from_numpy(rng.integers(0, 64, (8, 4096 // 256 * 144), dtype=np.uint8))   # finite float16 fields
want = [cpu_quant.linear(small, q8, Q.Q8_0, 4096, act="int8"), cpu_quant.linear(small, q4k, Q.Q4_K, 4096)]
M, K = 1024, 65536   # the activations (256 MB) exist; the kernels' own copies of them do not fit under the limit
x = torch.ones(M, K)
w8 = cpu_quant.repack(torch.from_numpy(gq.quantize(rng.standard_normal((8, K)).astype(np.float32), Q.Q8_0)), Q.Q8_0, K)
w4 = torch.from_numpy(rng.integers(0, 64, (8, K // 256 * 144), dtype=np.uint8))
vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))
calls = [lambda: cpu_quant.linear(x, w8, Q.Q8_0, K, act="int8", packed=True),
         lambda: cpu_quant.linear(x, w4, Q.Q4_K, K, act="int8")]
if cpu_quant.isa() == 512:   # the float path allocates only where Q4_K has its AVX-512 kernel
    calls.append(lambda: cpu_quant.linear(x, w4, Q.Q4_K, K))
for call in calls:
    try:
        call()
        print("computed")
    except SwiftkError as e:
        print("refused:", e)
again = [cpu_quant.linear(small, q8, Q.Q8_0, 4096, act="int8"), cpu_quant.linear(small, q4k, Q.Q4_K, 4096)]
print("same after" if all(torch.equal(a, b) for a, b in zip(want, again)) else "different after")
"""


def test_a_kernel_that_cannot_allocate_says_so(tmp_path):
    """Under an address-space limit the kernels' activation buffers cannot be allocated: each entry point returns
    its out-of-memory code (a SwiftkError here) instead of letting std::bad_alloc cross the C ABI (a crash), and the
    library computes as before once memory is there again. In a child process: the limit is process-wide."""
    script = tmp_path / "oom.py"
    script.write_text(_OOM_SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) in (3, 4) and set(lines[:-1]) == {"refused: cpu quant linear: out of memory for the kernel's "
                                                        "buffers"}, r.stdout
    assert lines[-1] == "same after", r.stdout
