"""Model configuration shared by every loader and the runtime.

One dataclass covers LLaMA-2, LLaMA-3/3.1 (llama3 RoPE scaling), Qwen2/2.5 (q/k/v bias) and SmolLM2.
Loaders fill it from GGUF metadata or a Hugging Face ``config.json``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from .errors import SwiftkError

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
        for k in ("vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            if getattr(self, k) <= 0:
                raise SwiftkError(f"model config: {k} must be positive, got {getattr(self, k)}")
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


def from_hf_config(c: dict, name: str = "") -> ModelConfig:
    """Build a ModelConfig from a Hugging Face ``config.json`` dict."""
    mt = c.get("model_type")
    arch = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama"}.get(mt)
    if arch is None:
        raise SwiftkError(f"unsupported architecture {mt!r} in config.json; swiftk supports llama, qwen2")
    n_heads = c["num_attention_heads"]
    hidden = c["hidden_size"]
    # transformers >= 5 writes "rope_parameters" (with rope_theta inside); older configs use "rope_scaling"
    rp = c.get("rope_parameters") or {}
    rs = c.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
    scaling = None
    if rs:
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype == "llama3":
            scaling = RopeScaling(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_position=int(rs["original_max_position_embeddings"]),
            )
        elif rtype not in (None, "default"):
            raise SwiftkError(f"unsupported rope_scaling type {rtype!r} (supported: llama3)")
    theta = c.get("rope_theta")
    if theta is None:
        theta = rp.get("rope_theta", 10000.0)
    return ModelConfig(
        arch=arch,
        vocab_size=c["vocab_size"],
        hidden_size=hidden,
        intermediate_size=c["intermediate_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=c.get("num_key_value_heads") or n_heads,
        head_dim=c.get("head_dim") or hidden // n_heads,
        rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position=int(c.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=bool(c.get("attention_bias", arch == "qwen2")),
        rope_scaling=scaling,
        name=name,
    ).validate()
