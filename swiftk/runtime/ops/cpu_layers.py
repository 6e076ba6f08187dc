"""The CPU backend of the whole layer stack: the fused layer loop ``swk_layers`` / ``swk_layers_multi``
(``kernels/cpu/cpu_decode.cpp``, from the one kernel library), driven by runtime/model.py. Its twin is the model's
op-by-op pass (runtime/model.py), which runs where :func:`fused_active` is False."""
from __future__ import annotations

from swiftk.runtime.ops import native

_fused = True   # set_fused(False): layers run op by op in torch (the A/B of kernels/cpu/cpu_decode.cpp)


def set_fused(on: bool) -> None:
    """Switch the fused CPU layer loop on or off for this process (benchmarks, tests); off, the layers run op by op
    through torch (with the matmul kernel still serving their matmuls)."""
    global _fused
    _fused = bool(on)


def fused_active() -> bool:
    return _fused and native.active()


def set_attention_tiles(on: bool) -> None:
    """Passes of several tokens attend in tiles of keys shared by their rows (on, the default) or per token, as a
    decode step (off): the same bits, for this process (benchmarks' A/B, tests). Needs the library."""
    native.library().swk_set_attention_tiles(1 if on else 0)


def layers_fn():
    """The C entry ``swk_layers`` (see kernels/cpu/cpu_decode.cpp). Call only where :func:`fused_active`."""
    return native.library().swk_layers


def layers_multi_fn():
    """The C entry ``swk_layers_multi``: rows of several sequences, each with its own cache, in one pass."""
    return native.library().swk_layers_multi


def layer_table_width() -> int:
    """Addresses per layer that ``swk_layers`` reads (a check that the Python side builds its table to match)."""
    return int(native.library().swk_layer_table_width())
