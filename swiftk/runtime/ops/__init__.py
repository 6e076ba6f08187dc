"""Op dispatch: the runtime calls ops through the namespace returned by :func:`get_ops`.

Per op the preference is cuda-extension > cupy > triton > torch, by device and availability:
- CPU: the CPU kernel library's ops where it is loaded (``cpu``: kv_commit, ops/cpu_kv.py), torch for the rest;
  other non-CUDA devices: torch. Triton only when forced with SWIFTK_BACKEND=triton, which needs the interpreter
  (TRITON_INTERPRET=1, set before the first kernel import). The library's other ops have one module each, and
  each falls back to its torch twin by itself: cpu_linear (float matmul) and cpu_quant (block matmul), picked per
  weight form by runtime/weights.py (the forms live above this layer); cpu_layers (the fused layer loop, driven
  by runtime/model.py); cpu_topk; cpu_accept (greedy tree walk); cpu_ngram (the corpus chain walk).
- CUDA: the swiftk._C kernels where built (tree_attention, kv_commit, fused_add_rmsnorm, rmsnorm), else the same
  CUDA sources compiled at first use through CuPy/NVRTC (swiftk/runtime/ops/cupy_ops.py), Triton for the rest (or
  everything when neither is there), torch when Triton is missing too.
SWIFTK_BACKEND=torch|triton|cupy|cuda forces a backend (``auto`` or unset = the rule above); a forced backend that
is not usable raises SwiftkError naming why. Forced ``cuda``/``cupy`` still serve the ops the kernels lack with
triton/torch.
:func:`describe` reports the choice (op -> backend) for ``swiftk info``.
"""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Optional

import torch

from swiftk.errors import SwiftkError

from . import reference

OP_NAMES = ("rmsnorm", "fused_add_rmsnorm", "apply_rope", "swiglu", "attention", "tree_attention", "kv_commit")
BACKENDS = ("torch", "triton", "cupy", "cuda")
ENV_VAR = "SWIFTK_BACKEND"

_cache: dict = {}


def requested_backend() -> Optional[str]:
    """The forced backend from SWIFTK_BACKEND, or None for automatic choice."""
    v = os.environ.get(ENV_VAR, "").strip().lower()
    if v in ("", "auto"):
        return None
    if v not in BACKENDS:
        raise SwiftkError(f"{ENV_VAR}={v!r} is not one of auto, {', '.join(BACKENDS)}")
    return v


def _torch_ops() -> dict:
    return {name: getattr(reference, name) for name in OP_NAMES}


def _triton_ops(dev: torch.device, forced: bool) -> Optional[dict]:
    """Triton ops for this device, None if unusable (or SwiftkError when forced)."""
    from . import triton_ops   # lazy: a GPU backend, loaded only for CUDA or SWIFTK_BACKEND=triton

    if dev.type == "cpu" and not triton_ops.interpret_mode():
        if forced:
            raise SwiftkError(f"{ENV_VAR}=triton on CPU needs the Triton interpreter: set TRITON_INTERPRET=1 "
                              "before starting (or use a CUDA device)")
        return None
    if dev.type not in ("cpu", "cuda"):
        if forced:
            raise SwiftkError(f"{ENV_VAR}=triton: device type {dev.type!r} not supported (cuda, or cpu with "
                              "TRITON_INTERPRET=1)")
        return None
    ok, why = triton_ops.available()
    if not ok:
        if forced:
            raise SwiftkError(f"{ENV_VAR}=triton but {why}")
        return None
    return triton_ops.ops()


def _select(dev: torch.device) -> tuple[dict, dict]:
    """(op -> implementation, op -> backend name)."""
    req = requested_backend()
    impl, chosen = _torch_ops(), {name: "torch" for name in OP_NAMES}
    if req == "torch":
        return impl, chosen
    if req is None and dev.type == "cpu":
        from . import cpu_kv   # lazy: only a CPU device reaches it (its available() loads the kernel library)

        if cpu_kv.available():
            impl["kv_commit"], chosen["kv_commit"] = cpu_kv.kv_commit, "cpu"
        return impl, chosen
    if req == "triton" or (req is None and dev.type == "cuda"):
        tri = _triton_ops(dev, forced=req == "triton")
        if tri is not None:
            impl.update(tri)
            chosen.update({name: "triton" for name in tri})
        if req == "triton":
            return impl, chosen
    if req in ("cuda", "cupy") or (req is None and dev.type == "cuda"):
        from . import cuda_ops, cupy_ops   # lazy: GPU backends, loaded only for CUDA or a forced backend

        if req in ("cuda", "cupy"):
            if dev.type != "cuda":
                raise SwiftkError(f"{ENV_VAR}={req} needs a CUDA device, got {dev}")
            if "triton" not in chosen.values():  # not yet tried for the ops the kernels lack
                tri = _triton_ops(dev, forced=False)
                if tri is not None:
                    impl.update(tri)
                    chosen.update({name: "triton" for name in tri})
        ext, name = None, None
        ok, why = cuda_ops.available()
        if ok and req != "cupy":
            ext, name = cuda_ops.extension(), "cuda"
        elif req in (None, "cupy"):
            ok2, why2 = cupy_ops.available()
            if ok2:
                ext, name = cupy_ops.extension(), "cupy"
            elif req == "cupy":
                raise SwiftkError(f"{ENV_VAR}=cupy but {why2}")
        if name is not None:
            cu = cuda_ops.make_ops(fallback=dict(impl), ext=ext)
            impl.update(cu)
            chosen.update({op: name for op in cu})
        elif req == "cuda":
            raise SwiftkError(f"{ENV_VAR}=cuda but {why}")
    return impl, chosen


def _key(device) -> tuple:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev, os.environ.get(ENV_VAR, ""), os.environ.get("TRITON_INTERPRET", "")


def get_ops(device) -> SimpleNamespace:
    """Namespace of ops by name for ``device``, plus ``name`` (backend, or 'a+b' when mixed) and ``backends``."""
    key = _key(device)
    if key not in _cache:
        _cache[key] = namespace(*_select(key[0]))
    return _cache[key]


def namespace(impl: dict, chosen: dict) -> SimpleNamespace:
    """The namespace the runtime calls (op name -> implementation, ``chosen``: op name -> backend name) with its
    per-pass planners; benchmarks build one per backend with it."""
    used = [b for b in ("cuda", "cupy", "triton", "cpu", "torch") if b in chosen.values()]
    ns = SimpleNamespace(name="+".join(used), backends=dict(chosen), **impl)
    ns.tree_attend = _tree_attend_planner(ns, dense=chosen["tree_attention"] == "torch")
    ns.rope_plan = _rope_planner(ns, tables=chosen["apply_rope"] == "torch")
    return ns


def _tree_attend_planner(ops, dense: bool):
    """tree_attend(mask, T, scale) -> f(q, kv_layer): the torch path attends with the dense mask (built once per
    pass, not once per layer); kernels read the packed bits."""
    if dense:
        def plan(mask, T, scale):
            m, S = mask.dense(), mask.prefix_len + T
            return lambda q, kv: ops.attention(q, kv[0, :, :S], kv[1, :, :S], m, scale).reshape(T, -1)
    else:
        def plan(mask, T, scale):
            bits = mask.packed()
            return lambda q, kv: ops.tree_attention(q, kv[0], kv[1], mask.prefix_len, bits, scale).reshape(T, -1)
    return plan


def _rope_planner(ops, tables: bool):
    """rope_plan(positions, inv_freq) -> f(x [T, heads, hd]): the torch path computes the cos/sin tables once per
    pass (not once per layer and per q/k); kernels compute them inline."""
    if tables:
        def plan(positions, inv_freq):
            cos, sin = reference.rope_tables(positions, inv_freq)
            return lambda x: reference.rope_with_tables(x, cos, sin)
    else:
        def plan(positions, inv_freq):
            return lambda x: ops.apply_rope(x, positions, inv_freq)
    return plan


def describe(device=None) -> dict:
    """op name -> backend chosen for ``device`` (default: cuda when torch sees one, else cpu)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return dict(get_ops(device).backends)


def clear_cache() -> None:
    """Forget cached choices (after changing SWIFTK_BACKEND at run time, e.g. in tests)."""
    _cache.clear()
