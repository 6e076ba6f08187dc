"""Model configuration shared by every loader and the runtime.

One dataclass covers LLaMA-2, LLaMA-3/3.1 (llama3 RoPE scaling), Qwen2/2.5 (q/k/v bias) and SmolLM2.
Loaders fill it from GGUF metadata or a Hugging Face ``config.json``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from ..errors import SwiftkError

SUPPORTED_ARCHS = ("llama", "qwen2")


@dataclass
class RopeScaling:
    """LLaMA-3.1 style frequency-dependent RoPE scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    rope_scaling: Optional[RopeScaling] = None
    # Per-frequency divisors [head_dim/2] (llama.cpp's ``rope_freqs`` tensor in LLaMA-3.1 GGUFs).
    rope_freq_factors: Optional[list] = None
    name: str = ""
    extra: dict = field(default_factory=dict)

    def validate(self) -> "ModelConfig":
        if self.arch not in SUPPORTED_ARCHS:
            raise SwiftkError(
                f"unsupported architecture {self.arch!r}; swiftk supports {', '.join(SUPPORTED_ARCHS)}"
            )
        for k in ("vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                  "max_position"):
            positive_int(getattr(self, k), f"model config: {k}")
        positive_float(self.rope_theta, "model config: rope_theta")
        if not _is_real(self.rms_eps) or self.rms_eps < 0:
            raise SwiftkError(f"model config: rms_eps must be a finite number >= 0, got {self.rms_eps!r}")
        if self.n_heads % self.n_kv_heads:
            raise SwiftkError(
                f"model config: n_heads ({self.n_heads}) is not a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise SwiftkError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def n_sublayers(self) -> int:
        """Length of a skip set: attention and MLP of every layer."""
        return 2 * self.n_layers


def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float64, with llama3 scaling applied when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    if cfg.rope_freq_factors is not None:
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64, device=device)
    s = cfg.rope_scaling
    if s is None:
        return inv
    # llama3: long wavelengths are divided by `factor`, short ones untouched, smooth blend in between.
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    return torch.where(mid, blended, scaled)


def _is_real(v) -> bool:
    """An int or float with a finite float value; bool is an int subclass, but True is never a size or rate."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def positive_int(value, what: str) -> int:
    """``value`` if it is an int > 0 (not a bool), else a SwiftkError naming ``what`` (the source's field name)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SwiftkError(f"{what} must be a positive integer, got {value!r}")
    return value


def positive_float(value, what: str) -> float:
    if not _is_real(value) or value <= 0:
        raise SwiftkError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


def from_hf_config(c: dict, name: str = "") -> ModelConfig:
    """Build a ModelConfig from a Hugging Face ``config.json`` dict.

    Every field is type-checked under its config.json name before any arithmetic, so a damaged file gives a
    SwiftkError naming the field instead of a ZeroDivisionError or TypeError. Missing required keys raise
    KeyError (the loader reports it with the file's path).
    """
    if not isinstance(c, dict):
        raise SwiftkError(f"config.json must hold a JSON object, got {type(c).__name__}")
    mt = c.get("model_type")
    arch = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama"}.get(mt) if isinstance(mt, str) else None
    if arch is None:
        raise SwiftkError(f"unsupported architecture {mt!r} in config.json; swiftk supports llama, qwen2")

    def count(key, default=None):
        v = c[key] if default is None else c.get(key)
        return positive_int(default if v is None else v, f"config.json {key}")

    def flag(key, default: bool) -> bool:
        v = c.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):  # bool("false") would be True
            raise SwiftkError(f"config.json {key} must be true or false, got {v!r}")
        return v

    n_heads = count("num_attention_heads")
    hidden = count("hidden_size")
    # transformers >= 5 writes "rope_parameters" (with rope_theta inside); older configs use "rope_scaling"
    rp = c.get("rope_parameters") or {}
    rs = c.get("rope_scaling")
    for key, v in (("rope_parameters", rp), ("rope_scaling", rs)):
        if v is not None and not isinstance(v, dict):
            raise SwiftkError(f"config.json {key} must be a JSON object, got {v!r}")
    rs = rs or (rp if rp.get("rope_type", "default") != "default" else None)
    scaling = None
    if rs:
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype == "llama3":
            scaling = RopeScaling(
                factor=positive_float(rs["factor"], "config.json rope_scaling.factor"),
                low_freq_factor=positive_float(rs["low_freq_factor"], "config.json rope_scaling.low_freq_factor"),
                high_freq_factor=positive_float(rs["high_freq_factor"], "config.json rope_scaling.high_freq_factor"),
                original_max_position=positive_int(rs["original_max_position_embeddings"],
                                                   "config.json rope_scaling.original_max_position_embeddings"),
            )
        elif rtype not in (None, "default"):
            raise SwiftkError(f"unsupported rope_scaling type {rtype!r} (supported: llama3)")
    theta = c.get("rope_theta")
    if theta is None:
        theta = rp.get("rope_theta", 10000.0)
    max_position = count("max_position_embeddings", 2048)
    # Sliding-window attention equals full attention on sequences no longer than the window: cap the context
    # there rather than attend past it (Qwen2 configs carry a window that is off unless use_sliding_window).
    if c.get("sliding_window") is not None and (arch != "qwen2" or flag("use_sliding_window", False)):
        max_position = min(max_position, count("sliding_window"))
    eps = c.get("rms_norm_eps", 1e-6)
    if not _is_real(eps) or eps < 0:
        raise SwiftkError(f"config.json rms_norm_eps must be a finite number >= 0, got {eps!r}")
    return ModelConfig(
        arch=arch,
        vocab_size=count("vocab_size"),
        hidden_size=hidden,
        intermediate_size=count("intermediate_size"),
        n_layers=count("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=count("num_key_value_heads", n_heads),
        # checked above: n_heads > 0, so the default cannot divide by zero
        head_dim=count("head_dim", hidden // n_heads),
        rms_eps=float(eps),
        rope_theta=positive_float(theta, "config.json rope_theta"),
        max_position=max_position,
        tie_embeddings=flag("tie_word_embeddings", False),
        qkv_bias=flag("attention_bias", arch == "qwen2"),
        rope_scaling=scaling,
        name=name,
    ).validate()
