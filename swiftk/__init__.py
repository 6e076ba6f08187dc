"""swiftk: lossless speculative decoding for LLaMA-family models.

    import swiftk
    eng = swiftk.load("smollm2-135m")               # registry name, .gguf path or HF directory
    out = eng.generate("def fib(n):", max_new_tokens=64)   # method="swift" by default, greedy
    out.text, out.token_ids, out.stats
    eng.generate(prompt, proposers=[my_source])     # any object with propose(tokens) -> list[int]
"""
from .errors import SwiftkError
from .registry import DEFAULT_MODEL, MODELS, pull

# The rest import torch (~4 s): loaded on first use, so `swiftk --help` is quick and the CLI owns Ctrl-C from its
# first line on (its entry point imports this package before it can catch anything).
_LAZY = {"load": "api", "generate": "api", "Engine": "engine", "GenerationResult": "generate",
         "DecodeConfig": "config", "OptimizerConfig": "config", "LearnedState": "state", "SkipSetState": "state"}

__version__ = "0.1.0"
__all__ = ["load", "generate", "pull", "Engine", "GenerationResult", "DecodeConfig", "OptimizerConfig",
           "LearnedState", "SkipSetState", "SwiftkError", "MODELS", "DEFAULT_MODEL", "__version__"]


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
