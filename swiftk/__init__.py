"""swiftk: lossless speculative decoding for LLaMA-family models.

    import swiftk
    eng = swiftk.load("smollm2-135m")               # registry name, .gguf path or HF directory
    out = eng.generate("def fib(n):", max_new_tokens=64)   # method="swift" by default, greedy
    out.text, out.token_ids, out.stats
    eng.generate(prompt, proposers=[my_source])     # any object with propose(tokens) -> list[int]
"""
from .api import generate, load
from .engine import Engine
from .errors import SwiftkError
from .generate import GenerationResult
from .registry import DEFAULT_MODEL, MODELS, pull
from .config import DecodeConfig, OptimizerConfig
from .state import LearnedState, SkipSetState

__version__ = "0.1.0"
__all__ = ["load", "generate", "pull", "Engine", "GenerationResult", "DecodeConfig", "OptimizerConfig",
           "LearnedState", "SkipSetState", "SwiftkError", "MODELS", "DEFAULT_MODEL", "__version__"]
