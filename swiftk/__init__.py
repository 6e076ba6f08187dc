"""swiftk: lossless speculative decoding for LLaMA-family models.

    import swiftk
    eng = swiftk.load("smollm2-135m")               # registry name, .gguf path or HF directory
    out = eng.generate("def fib(n):", max_new_tokens=64)   # method="swift" by default, greedy
    out.text, out.token_ids, out.stats
    eng.generate(prompt, proposers=[my_source])     # any object with propose(tokens) -> list[int]
"""
import importlib
import sys
import types

from .errors import SwiftkError
from .loading.registry import DEFAULT_MODEL, MODELS, pull

# The rest import torch (~4 s): loaded on first use, so `swiftk --help` is quick and the CLI owns Ctrl-C from its
# first line on (its entry point imports this package before it can catch anything).
_LAZY = {"load": "api", "generate": "api", "Engine": "engine", "GenerationResult": "decoding.output",
         "DecodeConfig": "options", "OptimizerConfig": "options", "LearnedState": "decoding.state",
         "SkipSetState": "decoding.state", "Grammar": "decoding.grammar"}

__version__ = "0.1.0"
__all__ = ["load", "generate", "pull", "Engine", "GenerationResult", "DecodeConfig", "OptimizerConfig",
           "LearnedState", "SkipSetState", "Grammar", "SwiftkError", "MODELS", "DEFAULT_MODEL", "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for n, mod in _LAZY.items():   # all at once, after every submodule they import has loaded
        globals()[n] = getattr(importlib.import_module(f".{mod}", __name__), n)
    return globals()[name]


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # importing the submodule swiftk.generate sets the package's attribute "generate" to it; the function
        # swiftk.generate() keeps the name (as the eager imports this replaced made it)
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
