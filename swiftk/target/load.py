"""A target from a loaded checkpoint: the numerical model on its device, the engine's first KV cache, and the cost
model timed on this machine. The engine's load options are checked here, before the weights are converted."""
from __future__ import annotations

import os
from typing import Optional

from ..errors import SwiftkError
from ..runtime.kvcache import KVCache
from ..runtime.model import Model, check_device_dtype, resolve_device, resolve_dtype
from . import Target
from .costs import CostModel, timed_passes


def check_context(max_context, model_context: int) -> int:
    """The context the engine holds: ``max_context`` checked against the model's (default: min(its, 4096))."""
    if model_context < 2:
        raise SwiftkError(f"the model's context length is {model_context} tokens (config or GGUF context_length); "
                          f"decoding needs at least 2")
    if max_context is None:
        return min(model_context, 4096)
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
        raise SwiftkError(f"max_context must be an int >= 2, got {max_context!r}")
    if max_context > model_context:
        raise SwiftkError(f"max_context {max_context} exceeds the model's context length {model_context}")
    return max_context


def load_target(checkpoint, *, device, dtype, max_context: Optional[int], weights: Optional[str],
                activations: Optional[str], kv_cache: Optional[str], cuda_graphs: Optional[bool],
                drafter: Optional[str], scratch: int) -> tuple[Target, KVCache]:
    """The target and slot 0's KV cache (``max_context + scratch`` slots). Takes the checkpoint's tensors (the model
    holds its own fused copies). Options as :class:`~swiftk.engine.Engine` documents them."""
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    check_device_dtype(device, dtype)
    max_context = check_context(max_context, checkpoint.config.max_position)
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise SwiftkError(f"cuda_graphs must be True, False or None, got {cuda_graphs!r}")
    if cuda_graphs and device.type != "cuda":
        raise SwiftkError(f"cuda_graphs=True needs a CUDA device, got {device}")
    if kv_cache is None and weights == "native" and activations in (None, "int8"):
        kv_cache = "float16"   # llama.cpp's arithmetic, its cache too; activations="float32" stays the exact model
    model = Model(checkpoint.config, checkpoint.tensors, device=device, dtype=dtype, weights=weights,
                  activations=activations, kv_cache=kv_cache)
    checkpoint.tensors = {}   # free the loader's copies
    cache = model.new_cache(max_context + scratch)
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda" and os.environ.get("SWIFTK_CUDA_GRAPHS", "1") != "0"
    if cuda_graphs:
        model.enable_graphs(cache)
    costs = CostModel(model)
    if device.type == "cpu":   # 8 passes (31 ms on SmolLM2, 0.23 s on a 1.5B) that also page weights in
        costs.calibrate(*timed_passes(model, cache, 8), 8)
    target = Target(model, checkpoint.tokenizer, checkpoint.identity, max_context, cache.max_slots, costs, drafter)
    return target, cache
