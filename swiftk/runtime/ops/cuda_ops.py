"""CUDA-extension backend: thin wrappers passing tensor pointers, shapes, strides, dtype and stream to ``swiftk._C``.

The extension (kernels/cuda/*.cu + csrc/, built by CMake through setup.py) covers tree_attention, kv_commit,
fused_add_rmsnorm and rmsnorm. Inputs outside what the kernels take (mixed dtypes, CPU tensors, head_dim > 256,
very long commit lists) go to the fallback implementation the dispatcher passes in, so results never depend on
which backend served a call.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from swiftk.errors import SwiftkError

CUDA_OPS = ("rmsnorm", "fused_add_rmsnorm", "tree_attention", "kv_commit")
_KV_COMMIT_SMEM = 32 * 1024  # kKvCommitSmemBytes in kernels/cuda/swiftk_cuda.cuh


def extension():
    """The compiled module, or None when it was not built."""
    try:
        # lazy: optional, built only with a CUDA toolchain (None when absent)
        from swiftk import _C  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _C


def available() -> tuple[bool, str]:
    if extension() is None:
        return False, ("the CUDA extension swiftk._C is not built (reinstall with a CUDA toolchain, or "
                       "SWIFTK_BUILD_CUDA=1 pip install -e .)")
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    return True, "ok"


def _dtype_code(ext, dt: torch.dtype) -> Optional[int]:
    return {torch.float32: ext.FLOAT32, torch.float16: ext.FLOAT16, torch.bfloat16: ext.BFLOAT16}.get(dt)


def _on_cuda(*ts: torch.Tensor) -> bool:
    dev = ts[0].device
    return dev.type == "cuda" and all(t.device == dev for t in ts)


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _kv_commit(ext, fallback: dict, cache, src_slots, dst_slots) -> None:
    """Copy KV rows ``src_slots`` -> ``dst_slots`` of every layer on the GPU (the fallback's for what the kernel
    does not take)."""
    code = _dtype_code(ext, cache.dtype)
    n = src_slots.numel()
    if (code is None or not _on_cuda(cache, src_slots, dst_slots) or cache.dim() != 5
            or cache.stride(-1) != 1 or n * cache.element_size() > _KV_COMMIT_SMEM):
        return fallback["kv_commit"](cache, src_slots, dst_slots)
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise SwiftkError(f"kv_commit: src {tuple(src_slots.shape)} / dst {tuple(dst_slots.shape)} must be equal 1-D")
    src = src_slots.to(torch.int64).contiguous()
    dst = dst_slots.to(torch.int64).contiguous()
    L, _, KV, _, hd = cache.shape
    ext.kv_commit(cache.data_ptr(), src.data_ptr(), dst.data_ptr(), n, L, KV, hd, cache.stride(0),
                  cache.stride(1), cache.stride(2), cache.stride(3), code, _stream(cache))


def make_ops(fallback: dict[str, Callable], ext=None) -> dict[str, Callable]:
    """op name -> CUDA wrapper; ``fallback`` holds the next backend's ops for inputs the kernels do not take.
    ``ext``: the entry points (default ``swiftk._C``; the CuPy backend passes its NVRTC-compiled twin)."""
    ext = ext if ext is not None else extension()
    if ext is None:
        raise SwiftkError(available()[1])

    def tree_attention(q, k_cache, v_cache, prefix_len, tree_bits, scale):
        code = _dtype_code(ext, q.dtype)
        if (code is None or not _on_cuda(q, k_cache, v_cache, tree_bits) or q.dim() != 3
                or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or tree_bits.dtype != torch.int32
                or q.shape[-1] > ext.MAX_HEAD_DIM or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
            return fallback["tree_attention"](q, k_cache, v_cache, prefix_len, tree_bits, scale)
        T, H, hd = q.shape
        KV = k_cache.shape[0]
        prefix_len = int(prefix_len)
        if k_cache.shape[1] < prefix_len + T or v_cache.shape != k_cache.shape or k_cache.shape[2] != hd:
            raise SwiftkError(f"tree_attention: cache {tuple(k_cache.shape)} too small or mismatched for "
                              f"prefix_len {prefix_len} + {T} new tokens, head_dim {hd}")
        if tree_bits.shape[0] != T or tree_bits.shape[1] < (T + 31) // 32:
            raise SwiftkError(f"tree_attention: tree_bits shape {tuple(tree_bits.shape)} != [{T}, {(T + 31) // 32}]")
        q = _unit_last(q)
        bits = _unit_last(tree_bits)
        out = torch.empty((T, H, hd), dtype=q.dtype, device=q.device)
        ext.tree_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), bits.data_ptr(),
                           T, H, KV, hd, prefix_len, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                           v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), bits.stride(0),
                           float(scale), code, _stream(q))
        return out

    def kv_commit(cache, src_slots, dst_slots):
        return _kv_commit(ext, fallback, cache, src_slots, dst_slots)

    def _norm(delta, residual, weight, eps, skip_flag):
        D = residual.shape[-1]
        res = _unit_last(residual).reshape(-1, D)
        dl = _unit_last(delta).reshape(-1, D) if delta is not None else None
        normed = torch.empty(res.shape, dtype=residual.dtype, device=residual.device)
        new_res = torch.empty_like(normed) if delta is not None else None
        skip_ptr = 0
        if skip_flag is not None:
            f = skip_flag.reshape(1)
            f = f.view(torch.uint8) if f.dtype == torch.bool else (f != 0).view(torch.uint8)
            skip_ptr = f.data_ptr()
        ext.fused_add_rmsnorm(dl.data_ptr() if dl is not None else 0, res.data_ptr(), weight.data_ptr(), skip_ptr,
                              normed.data_ptr(), new_res.data_ptr() if new_res is not None else 0, res.shape[0], D,
                              dl.stride(0) if dl is not None else 0, res.stride(0), normed.stride(0),
                              new_res.stride(0) if new_res is not None else 0, float(eps),
                              _dtype_code(ext, residual.dtype), _stream(residual))
        return normed.view(residual.shape), (new_res.view(residual.shape) if new_res is not None else None)

    def _norm_ok(tensors, weight) -> bool:
        dt = tensors[0].dtype
        return (_dtype_code(ext, dt) is not None and _on_cuda(*tensors, weight)
                and all(t.dtype == dt for t in tensors) and weight.dtype == dt
                and weight.dim() == 1 and weight.stride(0) == 1 and weight.shape[0] == tensors[0].shape[-1])

    def fused_add_rmsnorm(delta, residual, weight, eps, skip_flag=None):
        skip_ok = skip_flag is None or (isinstance(skip_flag, torch.Tensor) and skip_flag.numel() == 1
                                        and skip_flag.device == residual.device)
        if not (skip_ok and delta.shape == residual.shape and _norm_ok([delta, residual], weight)):
            return fallback["fused_add_rmsnorm"](delta, residual, weight, eps, skip_flag)
        return _norm(delta, residual, weight, eps, skip_flag)

    def rmsnorm(x, weight, eps):
        if not _norm_ok([x], weight):
            return fallback["rmsnorm"](x, weight, eps)
        return _norm(None, x, weight, eps, None)[0]

    return {"rmsnorm": rmsnorm, "fused_add_rmsnorm": fused_add_rmsnorm, "tree_attention": tree_attention,
            "kv_commit": kv_commit}
