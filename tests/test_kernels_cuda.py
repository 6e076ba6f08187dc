"""CUDA extension swiftk._C vs the torch reference twins.

Every kernel test runs for both ways the same kernels/cuda/*.cu reach the GPU: the compiled extension (``cuda``) and
CuPy's NVRTC (``cupy``, swiftk/runtime/ops/cupy_ops.py). GPU tests are marked ``gpu`` and skipped without a CUDA device,
or for a backend that is missing (extension not built, CuPy not importable). The argument-check test runs for the
extension wherever it imports and for the CuPy twin everywhere (its checks come before any CuPy call).
Tolerance per element: |cuda - reference| <= tol * (1 + |reference|), fp32 1e-4, fp16 5e-3, bf16 3e-2.
"""
import math

import pytest
import torch

from swiftk.runtime.ops import cuda_ops, cupy_ops, reference as R

EXT = cuda_ops.extension()
try:
    import cupy  # noqa: F401  (importable decides whether the cupy backend is tested)
    HAVE_CUPY = True
except Exception:
    HAVE_CUPY = False


def gpu_test(f):
    """Marked ``gpu``; skipped without a CUDA device (a missing backend skips in the ``cu`` fixture)."""
    f = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")(f)
    return pytest.mark.gpu(f)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def close(a, b, dtype, scale=1.0):
    assert a.shape == b.shape and a.dtype == b.dtype
    a, b = a.float(), b.float()
    ratio = ((a - b).abs() / (1 + b.abs())).max().item()
    assert ratio <= TOL[dtype] * scale, f"{ratio} > {TOL[dtype] * scale} ({dtype})"


@pytest.fixture(scope="module", params=["cuda", "cupy"])
def cu(request):
    if request.param == "cuda" and EXT is None:
        pytest.skip("swiftk._C not built")
    if request.param == "cupy" and not HAVE_CUPY:
        pytest.skip("cupy not importable")

    def no_fallback(name):
        def f(*a, **k):
            raise AssertionError(f"{name} fell back: inputs should be served by the CUDA kernel")
        return f
    ext = EXT if request.param == "cuda" else cupy_ops.extension()
    return cuda_ops.make_ops({name: no_fallback(name) for name in cuda_ops.CUDA_OPS}, ext=ext)


def tree_mask(T, g):
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        m[i, i] = True
        if i:
            m[i] |= m[int(torch.randint(0, i, (1,), generator=g))]
    return m


@pytest.mark.parametrize("backend", ["cuda", "cupy"])
def test_entry_points_reject_bad_arguments(backend):
    """The C ABI (swiftk._C) and its CuPy twin check arguments alike, before anything reaches the GPU (the CuPy
    twin's checks need no CuPy)."""
    if backend == "cuda" and EXT is None:
        pytest.skip("swiftk._C not built")
    X = EXT if backend == "cuda" else cupy_ops.extension()
    with pytest.raises(ValueError, match="multiple of kv heads"):
        X.tree_attention(1, 1, 1, 1, 1, 2, 3, 2, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1.0, X.FLOAT32, 0)
    with pytest.raises(ValueError, match="head_dim"):
        X.tree_attention(1, 1, 1, 1, 1, 2, 2, 2, 512, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1.0, X.FLOAT32, 0)
    with pytest.raises(ValueError, match="dtype"):
        X.kv_commit(1, 1, 1, 2, 1, 1, 64, 0, 0, 0, 0, 99, 0)
    with pytest.raises(ValueError, match="new_residual"):
        X.fused_add_rmsnorm(1, 1, 1, 0, 1, 0, 1, 64, 64, 64, 64, 64, 1e-6, X.FLOAT32, 0)


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,KV,hd,P", [(1, 9, 3, 64, 300), (5, 3, 3, 128, 0), (70, 8, 2, 128, 129),
                                         (12, 6, 2, 80, 9), (40, 32, 8, 256, 1000)])
def test_tree_attention(cu, dtype, T, H, KV, hd, P):
    g = torch.Generator().manual_seed(T + hd + P)
    cache = torch.randn(3, 2, KV, P + T + 5, hd, generator=g).to(dtype).cuda()
    k, v = cache[2, 0, :, : P + T], cache[2, 1, :, : P + T]
    q = torch.randn(T, H, hd, generator=g).to(dtype).cuda()
    bits = R.pack_tree_mask(tree_mask(T, g)).cuda()
    s = 1 / math.sqrt(hd)
    close(cu["tree_attention"](q, k, v, P, bits, s), R.tree_attention(q, k, v, P, bits, s), dtype, scale=2)


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 26])
def test_kv_commit(cu, dtype, n):
    g = torch.Generator().manual_seed(n)
    P, L, KV, hd = 50, 4, 2, 128
    cache = torch.randn(L, 2, KV, P + 64, hd, generator=g).to(dtype).cuda()
    path = torch.sort(torch.randperm(60, generator=g)[:n]).values + P
    path[0] = P
    src, dst = path.cuda(), torch.arange(P, P + n).cuda()
    want = cache.clone()
    R.kv_commit(want, src, dst)
    cu["kv_commit"](cache, src, dst)
    assert torch.equal(cache, want)
    # a permutation of the same slots: reads must see the old values
    src2 = torch.flip(dst, [0])
    R.kv_commit(want, src2, dst)
    cu["kv_commit"](cache, src2, dst)
    assert torch.equal(cache, want)


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 576, 4097])
def test_fused_add_rmsnorm(cu, dtype, D):
    g = torch.Generator().manual_seed(D)
    T = 7
    x, d, w = (torch.randn(*s, generator=g).to(dtype).cuda() for s in ((T, D), (T, D), (D,)))
    skip = torch.tensor([False, True]).cuda()
    for flag in (None, skip[0], skip[1]):
        nk, rk = cu["fused_add_rmsnorm"](d, x, w, 1e-5, flag)
        nr, rr = R.fused_add_rmsnorm(d, x, w, 1e-5, flag)
        close(rk, rr, dtype)
        close(nk, nr, dtype, scale=4)
    close(cu["rmsnorm"](x, w, 1e-5), R.rmsnorm(x, w, 1e-5), dtype, scale=4)


def test_cupy_kv_commit_rejects_a_commit_past_its_shared_memory():
    X = cupy_ops.extension()
    with pytest.raises(ValueError, match="too many slots"):
        X.kv_commit(1, 1, 1, 10_000, 1, 1, 64, 0, 0, 0, 0, X.FLOAT32, 0)


def test_cupy_parameter_structs_match_the_c_layout(tmp_path):
    """The NumPy records CuPy passes by value must have the C structs' field offsets and size (compiled here from
    kernels/cuda/swiftk_cuda.cuh, its NVRTC branch, by the host compiler)."""
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    structs = {"TreeAttnParams": cupy_ops._dtypes()[0], "KvCommitParams": cupy_ops._dtypes()[1],
               "AddRmsNormParams": cupy_ops._dtypes()[2]}
    lines = ['#include <cstddef>', '#include <cstdio>', '#include "swiftk_cuda.cuh"', 'int main() {']
    for name, dt in structs.items():
        lines.append(f'  std::printf("{name} size %zu\\n", sizeof(swiftk::{name}));')
        for f in dt.names:
            lines.append(f'  std::printf("{name} {f} %zu\\n", offsetof(swiftk::{name}, {f}));')
    lines.append('  return 0;\n}')
    src = tmp_path / "layout.cpp"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run([cxx, "-std=c++17", "-D__CUDACC_RTC__", f"-I{cupy_ops._kernels_dir()}", str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    want = []
    for name, dt in structs.items():
        want.append(f"{name} size {dt.itemsize}")
        want += [f"{name} {f} {dt.fields[f][1]}" for f in dt.names]
    assert [g for g in got if g] == want
