"""Model configuration shared by every loader and the runtime.

One dataclass covers LLaMA-2, LLaMA-3/3.1 (llama3 RoPE scaling), Qwen2/2.5 (q/k/v bias) and SmolLM2.
Loaders fill it from GGUF metadata or a Hugging Face ``config.json``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
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


# ---------------------------------------------------------------------------------------------- decoding options
# Two concerns, two dataclasses. OptimizerConfig shapes the learned state (the skip-set search), so it is fixed
# when the state is made: ``swiftk.load(..., skip_ratio=0.3)`` or ``eng.reset_optimizer(skip_ratio=0.3)``.
# DecodeConfig is per round and may change on every call: ``eng.generate(p, max_draft=8)``.
# Every limit is written once, in the field's metadata, and checked by ``_validate``. Fields marked ``advanced``
# are research knobs (the paper's rules, the search's internals): accepted like the others, documented apart
# (docs/options.md), left out of the README's everyday tables.

def _opt(default, kind, lo=None, hi=None, choices=None, lo_open=False, help="", advanced=False):
    return field(default=default, metadata={"kind": kind, "lo": lo, "hi": hi, "choices": choices,
                                            "lo_open": lo_open, "help": help, "advanced": advanced})


def _validate(obj) -> None:
    for f in fields(obj):
        v, m = getattr(obj, f.name), f.metadata
        kind = m.get("kind")
        if kind is None:
            continue
        if kind is bool:
            ok = isinstance(v, bool)
        elif kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif kind is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        elif kind is str:
            ok = isinstance(v, str) and v in m["choices"]
        else:  # top-k bins
            ok = _valid_bins(v)
        if ok and kind in (int, float):
            lo, hi = m["lo"], m["hi"]
            ok = (lo is None or (v > lo if m["lo_open"] else v >= lo)) and (hi is None or v <= hi)
        if not ok:
            rng = m["choices"] and f"one of {', '.join(m['choices'])}" or _range_text(m)
            raise SwiftkError(f"{f.name} must be {rng}, got {v!r}")


def _range_text(m) -> str:
    kind = {bool: "a bool (True/False)", int: "an int", float: "a number"}.get(m["kind"], "(threshold, k>=1) pairs")
    lo, hi = m["lo"], m["hi"]
    if lo is not None and hi is not None:
        return f"{kind} in {'(' if m['lo_open'] else '['}{lo}, {hi}]"
    if lo is not None:
        return f"{kind} {'>' if m['lo_open'] else '>='} {lo}"
    return kind


def _bins_tuple(v):
    """Bins given as lists, as tuples (hashable, comparable); anything else unchanged, for _validate to name."""
    if isinstance(v, (list, tuple)) and all(isinstance(b, (list, tuple)) for b in v):
        return tuple(tuple(b) for b in v)
    return v


def _valid_bins(bins) -> bool:
    try:
        return bool(bins) and all(0.0 <= float(t) <= 1.0 and isinstance(k, int) and k >= 1 for t, k in bins)
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class OptimizerConfig:
    """The on-the-fly skip-set search (SWIFT section 4.1, with a speed objective; see proposers/layerskip/search.py)."""

    skip_ratio: float = _opt(0.45, float, 0.0, 0.95, lo_open=True,
                             help="objective=matchness: fraction of sublayers skipped (paper r); speed: the most")
    context_window: int = _opt(32, int, 4, 120, help="generated tokens a candidate's matchness is measured on", advanced=True)
    bayes_interval: int = _opt(25, int, 0, help="a Bayesian-optimization suggestion every this many steps (0: off)", advanced=True)
    max_opt_steps: int = _opt(1000, int, 0, help="optimization steps at most", advanced=True)
    patience: int = _opt(300, int, 1, help="stop after this many steps without a better incumbent", advanced=True)
    max_matchness: float = _opt(0.95, float, 0.0, 1.0, lo_open=True, help="... or once the incumbent's exceeds this", advanced=True)
    objective: str = _opt("speed", str, choices=("speed", "matchness"),
                          help="speed: expected tokens/s from matchness and measured draft cost; matchness: paper", advanced=True)
    rescore: int = _opt(3, int, 1, 16, help="windows a challenger is scored on before it replaces the incumbent", advanced=True)
    opt_budget: float = _opt(0.05, float, 0.0, 1.0, help="optimization's largest share of decode wall time")
    bo_mode: str = _opt("thread", str, choices=("thread", "sync"),
                        help="thread: GP suggestions off the decode loop; sync: inline (tests)", advanced=True)
    opt_seed: int = _opt(0, int, 0, 2**63 - 1, advanced=True)

    def validate(self) -> "OptimizerConfig":
        _validate(self)
        return self


GREEDY_TOPK = ((0.95, 3), (0.8, 5), (0.5, 8), (0.0, 10))    # candidates per depth by the draft's top-1 probability
SAMPLING_TOPK = ((0.95, 1), (0.8, 3), (0.5, 5), (0.0, 10))


@dataclass(frozen=True)
class DecodeConfig:
    """Per-round knobs of the speculative loop (swift.py); any of them may be given per call."""

    max_draft: int = _opt(25, int, 1, 64, help="max draft depth per round")
    eps: float = _opt(0.8, float, 0.0, 1.0, help="speculate='always': stop drafting below this top-1 probability", advanced=True)
    max_tree_nodes: int = _opt(0, int, 0, 64, help="verify budget; 0 = from the measured cost model")
    topk_greedy: tuple = _opt(GREEDY_TOPK, "bins", help="candidates per depth for greedy decoding", advanced=True)
    topk_sampling: tuple = _opt(SAMPLING_TOPK, "bins", help="... for sampling", advanced=True)
    optimize: bool = _opt(True, bool, help="False: keep the current skip set")
    kvq: bool = _opt(False, bool, help="reuse the draft's exact KV/residual below the first skipped layer")
    speculate: str = _opt("auto", str, choices=("auto", "always"),
                          help="auto: draft only when the cost model expects it to pay; always: every round (paper)")
    ngram: bool = _opt(True, bool, help="add the continuations of the context's tail where it occurred earlier in "
                       "the context (prompt lookup at any match length, suffix.SuffixIndex) to the tree")
    history: bool = _opt(True, bool, help="add the continuations of the context's tail in this state's earlier "
                         "outputs (suffix.OutputHistory: what the model generated for earlier prompts) to the tree")
    recycle: bool = _opt(True, bool, help="add Token Recycling candidates (the target's own top-k after each token "
                         "the last time it read it, proposers/recycle.py) to the tree")
    datastore: bool = _opt(True, bool, help="add corpus n-gram candidates (tables over the Python stdlib's source, "
                           "swiftk/proposers/datastore.py) to the tree where the context has nothing better")
    draft_vocab: int = _opt(8192, int, 0, help="draft logits over this many frequent tokens plus every token of "
                            "the context (proposers.draft_head.DraftHead); 0: the full LM head")
    trace: bool = _opt(False, bool, help="keep per-round lists in the stats (accept lengths, tree sizes, phases, "
                       "expected vs measured rates, the search's matchness) for debugging and plots")
    sampling: str = _opt("coupled", str, choices=("coupled", "rejection"),
                         help="coupled: seeded output independent of the draft; rejection: tree speculative sampling")

    def validate(self) -> "DecodeConfig":
        _validate(self)
        if self.max_tree_nodes == 1:
            raise SwiftkError("max_tree_nodes must be 0 (auto) or an int in [2, 64], got 1")
        return self


def option_names(cls, advanced: Optional[bool] = None) -> set:
    """Field names of a config class; ``advanced`` True / False: only the research knobs / only the others."""
    return {f.name for f in fields(cls) if advanced is None or f.metadata.get("advanced", False) == advanced}


def updated(base, kw: dict):
    """``base`` with the fields in ``kw`` replaced, validated (bins given as lists become tuples)."""
    kw = {k: (_bins_tuple(v) if k.startswith("topk_") else v) for k, v in kw.items()}
    try:
        return replace(base, **kw).validate()
    except TypeError as e:
        raise SwiftkError(str(e)) from None
