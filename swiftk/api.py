"""The thin public API: load an engine, or generate with a cached one."""
from __future__ import annotations

import threading

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
    (all in ``dtype``), "bfloat16" or "int8" (CPU weight formats read by swiftk's matmul kernel, float32
    activations; a rounded target model, see swiftk.model.Model); ``drafter``: a trained MoA drafter file for
    ``method="moa"`` (default: found by model name, ``swiftk train-drafter`` writes it); ``cuda_graphs``: replay
    the decode loop's small passes from CUDA graphs (default: on for a CUDA device; see swiftk/graphs.py)."""
    from .loaders import load_checkpoint

    dev = resolve_device(device)       # validate before any download or load
    dt = resolve_dtype(dtype)
    check_device_dtype(dev, dt)
    path = resolve_model(model)
    ckpt = load_checkpoint(path, dtype=dt, native=weights == "native")
    if model in _registry_names():
        ckpt.identity["name"] = model
    return Engine(ckpt, device=dev, dtype=dt, max_context=max_context, persist=persist, weights=weights,
                  drafter=drafter, cuda_graphs=cuda_graphs, **options)


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
