"""swiftk: lossless on-the-fly self-speculative decoding (SWIFT) for LLaMA-family models.

    import swiftk
    eng = swiftk.load("smollm2-135m")               # registry name, .gguf path or HF directory
    out = eng.generate("def fib(n):", max_new_tokens=64)   # method="swift" by default, greedy
    out.text, out.token_ids, out.stats
"""
from .api import generate, load
from .engine import Engine
from .errors import SwiftkError
from .generate import GenerationResult
from .registry import DEFAULT_MODEL, MODELS, pull
from .config import DecodeConfig, OptimizerConfig
from .state import SkipSetState

__version__ = "0.1.0"
__all__ = ["load", "generate", "pull", "Engine", "GenerationResult", "DecodeConfig", "OptimizerConfig", "SkipSetState", "SwiftkError", "MODELS",
           "DEFAULT_MODEL", "__version__"]
