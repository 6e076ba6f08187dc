"""The thin public API: load an engine, or generate with a cached one."""
from __future__ import annotations

import threading

import torch

from .engine import Engine
from .errors import SwiftkError
from .registry import DEFAULT_MODEL, resolve_model
from .model import check_device_dtype, resolve_device, resolve_dtype

_engines: dict = {}
_lock = threading.Lock()
LOAD_OPTIONS = ("device", "dtype", "max_context", "persist", "weights", "drafter", "cuda_graphs")


def load(model: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32", max_context=None, persist=None,
         weights=None, drafter=None, cuda_graphs=None, **options) -> Engine:
    """An Engine for a registry name (pulled on first use), a ``.gguf`` path or a Hugging Face directory.

    ``options``: decode defaults and optimizer options (config.py); ``persist``: see Engine; ``weights``: None
    (CPU float32 on a block-quantized GGUF file: "native", else "float32"), "native" (the GGUF file's blocks,
    read by kernels/cpu_quant.cpp: exactly the file's model, float32 activations), "float32" (every weight
    converted to ``dtype``), "bfloat16" or "int8" (CPU formats of swiftk's matmul kernel, float32 activations; a
    rounded target model, see swiftk.model.Model); ``drafter``: a trained MoA drafter file for
    ``method="moa"`` (default: found by model name, ``swiftk train-drafter`` writes it); ``cuda_graphs``: replay
    the decode loop's small passes from CUDA graphs (default: on for a CUDA device; see swiftk/graphs.py)."""
    from .loaders import load_checkpoint

    dev = resolve_device(device)       # validate before any download or load
    dt = resolve_dtype(dtype)
    check_device_dtype(dev, dt)
    path = resolve_model(model)
    weights = resolve_weights(weights, dev, dt)
    ckpt = load_checkpoint(path, dtype=dt, native="auto" if weights == "auto" else weights == "native")
    if weights == "auto":
        weights = "native" if ckpt.native else None
    if model in _registry_names():
        ckpt.identity["name"] = model
    return Engine(ckpt, device=dev, dtype=dt, max_context=max_context, persist=persist, weights=weights,
                  drafter=drafter, cuda_graphs=cuda_graphs, **options)


def resolve_weights(weights, device, dtype):
    """None -> "auto" (the loader keeps a GGUF file's blocks when its layer matrices are block formats) on CPU with
    float32 activations when the block kernel builds, else the float32 path (None); "float32" -> None. Native is
    the default because it decodes faster (bench.runtime: 1.9x the float32 path on SmolLM2-135M) and is the same
    model up to float32 summation order."""
    from .model import WEIGHT_FORMATS

    if weights is not None and weights not in WEIGHT_FORMATS + ("float32",):
        raise SwiftkError(f"weights={weights!r}: use one of None, float32, {', '.join(WEIGHT_FORMATS)}")
    if weights is None and device.type == "cpu" and dtype == torch.float32:
        from .ops import cpu_linear, cpu_quant

        if cpu_linear.active() and cpu_quant.available():
            return "auto"
    return None if weights == "float32" else weights


def generate(prompt, model: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32", weights=None,
             max_context=None, persist=None, drafter=None, cuda_graphs=None, **kw):
    """``load(model, ...)`` once per process and set of load options, then ``Engine.generate(prompt, **kw)``.

    Every ``load`` option is accepted; the engine (and its learned state) is kept per (model, load options), so a
    stream of calls keeps improving the drafts."""
    opts = dict(device=device, dtype=dtype, weights=weights, max_context=max_context, persist=persist,
                drafter=drafter, cuda_graphs=cuda_graphs)
    key = (str(model), *(repr(opts[k]) for k in LOAD_OPTIONS))
    with _lock:
        eng = _engines.get(key)
        if eng is None:
            eng = _engines[key] = load(model, **opts)
    return eng.generate(prompt, **kw)


def _registry_names():
    from .registry import MODELS

    return MODELS


__all__ = ["load", "generate", "Engine", "SwiftkError"]
