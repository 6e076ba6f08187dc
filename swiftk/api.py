"""The thin public API: load an engine, or generate with a cached one."""
from __future__ import annotations

import os
import threading

import torch

from .engine import Engine
from .errors import SwiftkError
from .loading.loaders import load_checkpoint
from .loading.registry import DEFAULT_MODEL, MODELS, resolve_model
from .options import load_time
from .runtime.model import WEIGHT_FORMATS, check_device_dtype, resolve_device, resolve_dtype
from .runtime.kvcache import kv_dtype
from .runtime.ops import cpu_quant, native
from .runtime.ops.cpu_quant import ACTIVATIONS

_engines: dict = {}
_lock = threading.Lock()
LOAD_OPTIONS = ("device", "dtype", "max_context", "persist", "weights", "activations", "drafter", "draft_model",
                "cuda_graphs")


def load(model: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32", max_context=None, persist=None,
         weights=None, activations=None, drafter=None, draft_model=None, cuda_graphs=None, kv_cache=None,
         **options) -> Engine:
    """An Engine for a registry name (pulled on first use), a ``.gguf`` path or a Hugging Face directory.

    ``options``: decode defaults and optimizer options (config.py); ``persist``: see Engine; ``weights``: None
    (CPU float32 on a block-quantized GGUF file: "native", else "float32"), "native" (the GGUF file's blocks,
    memory = file size), "float32" (every weight converted to ``dtype``), "bfloat16" or "int8" (CPU formats of
    swiftk's matmul kernel, float32 activations; a rounded target model, see swiftk.runtime.model.Model);
    ``activations`` (native weights only): "int8" (the default there: activation rows quantized to int8 per block,
    integer dot products, as llama.cpp computes; kernels/cpu/cpu_qdot.cpp) or "float32" (the exact de-quantized model;
    kernels/cpu/cpu_quant.cpp); ``drafter``: a trained MoA drafter file for
    ``method="moa"`` (default: found by model name, ``swiftk train-drafter`` writes it); ``draft_model``: a smaller
    model with the same tokenizer (registry name or path, loaded like the target) that drafts for
    ``method="draft_model"``, then the default method (qwen2.5-coder-0.5b for qwen2.5-coder-1.5b);
    ``cuda_graphs``: replay the decode loop's small passes from CUDA graphs (default: on for a CUDA device; see
    swiftk/runtime/graphs.py); ``kv_cache``: the KV cache's element type, "float32" or "float16" on the CPU (default:
    float16 for a GGUF file's blocks under int8 activations, as llama.cpp keeps it, else the compute dtype; float16
    halves the bytes a step reads over a long context, see swiftk/runtime/kvcache.py)."""
    dev = resolve_device(device)       # validate before any download or load
    dt = resolve_dtype(dtype)
    check_device_dtype(dev, dt)
    kv_dtype(kv_cache, dev, dt)
    weights = resolve_weights(weights, dev, dt)
    _check_activations(activations, weights)
    if draft_model is not None and not isinstance(draft_model, (str, os.PathLike)):
        raise SwiftkError(f"draft_model must be a registry name or a path, got {type(draft_model).__name__}")
    path = resolve_model(model)   # both named and found (or pulled) before either loads
    dpath = None if draft_model is None else resolve_model(draft_model)
    ckpt, w = _checkpoint(model, path, dt, weights, activations)
    draft = None if draft_model is None else _checkpoint(draft_model, dpath, dt, weights, activations)
    if draft is not None and draft[1] != w:
        raise SwiftkError(f"draft_model {draft_model} loads as {draft[1] or 'float32'} weights, the target as "
                          f"{w or 'float32'}: give both the same kind of file")
    return Engine(ckpt, device=dev, dtype=dt, max_context=max_context, persist=persist, weights=w,
                  activations=activations, drafter=drafter, draft_model=None if draft is None else draft[0],
                  cuda_graphs=cuda_graphs, kv_cache=kv_cache, **options)


def _checkpoint(model, path, dt, weights, activations) -> tuple:
    """(the loaded checkpoint, its weight format) for a registry name or a path, resolved to ``path``."""
    ckpt = load_checkpoint(path, dtype=dt, native="auto" if weights == "auto" else weights == "native",
                           pack=activations in (None, "int8"))
    if weights == "auto":
        weights = "native" if ckpt.native else None
    if model in MODELS:
        ckpt.identity["name"] = model
    if activations is not None and weights != "native":
        raise SwiftkError(f"activations={activations!r} applies to GGUF block weights only; {model} loads as float "
                          "weights (not a block-quantized GGUF file, or weights= chose a float format)")
    return ckpt, weights


def _check_activations(activations, weights) -> None:
    """Before any download or load: the value, and that the weights can take it."""
    if activations is None:
        return
    if activations not in ACTIVATIONS:
        raise SwiftkError(f"activations={activations!r}: use one of None, {', '.join(ACTIVATIONS)}")
    if weights not in ("native", "auto"):
        raise SwiftkError(f"activations={activations!r} applies to GGUF block weights (weights='native') only, "
                          f"not weights={'float32' if weights is None else weights!r}")


def resolve_weights(weights, device, dtype):
    """None -> "auto" (the loader keeps a GGUF file's blocks when its layer matrices are block formats) on CPU with
    float32 activations when the block kernel builds, else the float32 path (None); "float32" -> None. Native is
    the default because it decodes faster (bench.runtime: 1.9x the float32 path on SmolLM2-135M) and is the same
    model up to float32 summation order."""
    if weights is not None and weights not in WEIGHT_FORMATS + ("float32",):
        raise SwiftkError(f"weights={weights!r}: use one of None, float32, {', '.join(WEIGHT_FORMATS)}")
    if weights is None and device.type == "cpu" and dtype == torch.float32:
        if native.active() and cpu_quant.available():
            return "auto"
    return None if weights == "float32" else weights


def generate(prompt, model: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32", weights=None,
             activations=None, max_context=None, persist=None, drafter=None, draft_model=None, cuda_graphs=None,
             **kw):
    """``load(model, ...)`` once per process and set of load options, then ``Engine.generate(prompt, **kw)``.

    Every ``load`` option is accepted; the engine (and its learned state) is kept per (model, load options), so a
    stream of calls keeps improving the drafts. With a ``draft_model``, ``draft_vocab`` sizes the draft's head at
    load, so it is a load option here too."""
    opts = dict(device=device, dtype=dtype, weights=weights, activations=activations, max_context=max_context,
                persist=persist, drafter=drafter, draft_model=draft_model, cuda_graphs=cuda_graphs)
    at_load = load_time(draft_model, kw)
    key = (str(model), *(repr(opts[k]) for k in LOAD_OPTIONS), repr(at_load))
    with _lock:
        eng = _engines.get(key)
        if eng is None:
            eng = _engines[key] = load(model, **opts, **at_load)
    return eng.generate(prompt, **kw)


__all__ = ["load", "generate", "Engine", "SwiftkError"]
