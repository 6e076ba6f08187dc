"""CuPy backend: the same CUDA sources as the compiled extension (kernels/cuda/*.cu), compiled at first use by NVRTC.

No build step: where ``swiftk._C`` was not built (a plain ``pip install``) but CuPy is importable and torch sees a
GPU, :func:`extension` returns an object with the extension's entry points (same arguments, same checks as
csrc/capi.cpp), so :func:`swiftk.runtime.ops.cuda_ops.make_ops` wraps it exactly as it wraps ``swiftk._C``; the kernels are
the nvcc build's, instantiated by name (``swiftk::tree_attention_kernel<float>`` ...) in a ``cupy.RawModule``.
The headers guard their host-only parts with ``__CUDACC_RTC__``. Parameter structs are passed by value as NumPy
structured scalars laid out like the C structs (``align=True``).
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from .triton_ops import kernels_package

FLOAT32, FLOAT16, BFLOAT16 = 0, 1, 2     # swiftk_dtype codes (csrc/include/swiftk.h)
MAX_HEAD_DIM = 256                       # SWIFTK_MAX_HEAD_DIM
KV_COMMIT_SMEM = 32 * 1024               # kKvCommitSmemBytes
_CTYPE = {FLOAT32: "float", FLOAT16: "__half", BFLOAT16: "__nv_bfloat16"}
_ELEM = {FLOAT32: 4, FLOAT16: 2, BFLOAT16: 2}


def available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    try:
        import cupy  # noqa: F401  (optional: importable is the test)
    except Exception as e:   # ImportError, or a CuPy built for another CUDA raising at import
        return False, f"cupy cannot be imported ({type(e).__name__}: {e})"
    return True, "ok"


def _kernels_dir() -> Path:
    return Path(kernels_package().__file__).resolve().parent / "cuda"


@functools.lru_cache(maxsize=None)
def _module(file: str, kernel: str):
    """The RawModule of one .cu file with the kernel instantiated for the three dtypes."""
    import cupy   # lazy: optional (checked by available())

    folder = _kernels_dir()
    names = tuple(f"swiftk::{kernel}<{t}>" for t in _CTYPE.values())
    mod = cupy.RawModule(code=(folder / file).read_text(), options=("--std=c++17", f"-I{folder}"),
                         name_expressions=names)
    return mod, names


def _function(file: str, kernel: str, dtype: int):
    mod, names = _module(file, kernel)
    return mod.get_function(names[dtype])


def _struct(fields: list):
    dt = np.dtype({"names": [n for n, _ in fields], "formats": [f for _, f in fields]}, align=True)
    return dt


_PTR, _I64, _F32 = "u8", "i8", "f4"


@functools.lru_cache(maxsize=None)
def _dtypes():
    tree = _struct([("q", _PTR), ("k", _PTR), ("v", _PTR), ("out", _PTR), ("bits", _PTR)]
                   + [(n, _I64) for n in ("T", "H", "KV", "hd", "prefix_len", "sqt", "sqh", "skh", "sks", "svh",
                                          "svs", "sot", "soh", "sbt")] + [("scale", _F32)])
    kvc = _struct([("cache", _PTR), ("src", _PTR), ("dst", _PTR)]
                  + [(n, _I64) for n in ("n", "L", "KV", "hd", "s_l", "s_c", "s_h", "s_s")])
    norm = _struct([(n, _PTR) for n in ("delta", "residual", "weight", "skip", "normed", "new_residual")]
                   + [(n, _I64) for n in ("rows", "D", "s_delta", "s_res", "s_normed", "s_newres")]
                   + [("eps", _F32)])
    return tree, kvc, norm


def _record(dt, values: tuple):
    return np.array([values], dtype=dt)[0]


def _launch(fn, grid, block, args, stream: int, shared_mem: int = 0) -> None:
    import cupy   # lazy: optional (checked by available())

    with cupy.cuda.ExternalStream(stream):
        fn(grid, block, args, shared_mem=shared_mem)


def _check_dtype(dtype: int, op: str) -> None:
    if dtype not in _CTYPE:
        raise ValueError(f"{op}: unknown dtype code")


class _Extension:
    """The entry points of ``swiftk._C`` (csrc/bindings.cpp), launched through CuPy."""

    FLOAT32, FLOAT16, BFLOAT16, MAX_HEAD_DIM = FLOAT32, FLOAT16, BFLOAT16, MAX_HEAD_DIM

    def tree_attention(self, q, k, v, out, bits, T, H, KV, hd, prefix_len, sqt, sqh, skh, sks, svh, svs, sot, soh,
                       sbt, scale, dtype, stream):
        op = "tree_attention"
        _check_dtype(dtype, op)
        if T < 0 or H <= 0 or KV <= 0 or hd <= 0 or prefix_len < 0:
            raise ValueError(f"{op}: negative or zero size")
        if H % KV:
            raise ValueError(f"{op}: query heads not a multiple of kv heads")
        if hd > MAX_HEAD_DIM:
            raise ValueError(f"{op}: head_dim > {MAX_HEAD_DIM}")
        if T == 0:
            return
        if sbt < (T + 31) // 32:
            raise ValueError(f"{op}: tree_bits row stride < ceil(T/32)")
        p = _record(_dtypes()[0], (q, k, v, out, bits, T, H, KV, hd, prefix_len, sqt, sqh, skh, sks, svh, svs, sot,
                                   soh, sbt, scale))
        _launch(_function("tree_attention.cu", "tree_attention_kernel", dtype), (T, H), (128,), (p,), stream)

    def kv_commit(self, cache, src, dst, n, L, KV, hd, s_l, s_c, s_h, s_s, dtype, stream):
        op = "kv_commit"
        _check_dtype(dtype, op)
        if n < 0 or L < 0 or KV < 0 or hd <= 0:
            raise ValueError(f"{op}: negative or zero size")
        if n == 0 or L == 0 or KV == 0:
            return
        row_bytes = n * _ELEM[dtype]
        if row_bytes > KV_COMMIT_SMEM:
            raise ValueError(f"{op}: too many slots for one launch ({n})")
        chunk = min(KV_COMMIT_SMEM // row_bytes, hd)    # head_dim columns per pass that fit the shared buffer
        p = _record(_dtypes()[1], (cache, src, dst, n, L, KV, hd, s_l, s_c, s_h, s_s))
        _launch(_function("kv_commit.cu", "kv_commit_kernel", dtype), (L * 2 * KV,), (128,), (p, np.int64(chunk)),
                stream, shared_mem=int(chunk * row_bytes))

    def fused_add_rmsnorm(self, delta, residual, weight, skip, normed, new_residual, rows, D, s_delta, s_res,
                          s_normed, s_newres, eps, dtype, stream):
        op = "fused_add_rmsnorm"
        _check_dtype(dtype, op)
        if rows < 0 or D <= 0:
            raise ValueError(f"{op}: negative or zero size")
        if rows == 0:
            return
        if delta and not new_residual:
            raise ValueError(f"{op}: new_residual is required when delta is given")
        p = _record(_dtypes()[2], (delta, residual, weight, skip, normed, new_residual, rows, D, s_delta, s_res,
                                   s_normed, s_newres, eps))
        _launch(_function("add_rmsnorm.cu", "add_rmsnorm_kernel", dtype), (rows,), (256,), (p,), stream)


@functools.lru_cache(maxsize=None)
def extension() -> _Extension:
    return _Extension()
