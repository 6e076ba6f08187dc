"""Fixtures for the microbenchmarks (bench/test_micro.py): model shapes with random weights, op backends.

Shapes are the real models' configurations (no download: random weights built from a ModelConfig) plus a small
one for quick CPU runs (``pytest bench/ --benchmark-only -k small``). ``SWIFTK_BENCH_THREADS`` sets torch's CPU threads.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from swiftk.runtime.config import ModelConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _threads() -> int:
    """Torch CPU threads: $SWIFTK_BENCH_THREADS, default all cores (like bench.e2e --threads).

    On a busy machine use 1: OpenMP threads that wait on a descheduled sibling make small ops 100x+ slower.
    """
    v = os.environ.get("SWIFTK_BENCH_THREADS", "")
    n = int(v) if v.strip() else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, n))
    return n


THREADS = _threads()

SHAPES = {
    "small": ModelConfig(arch="llama", vocab_size=1024, hidden_size=128, intermediate_size=384, n_layers=6,
                         n_heads=4, n_kv_heads=2, head_dim=32, rms_eps=1e-5, rope_theta=10000.0, max_position=2048,
                         tie_embeddings=True, qkv_bias=False, name="small"),
    "smollm2-135m": ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, rms_eps=1e-5,
                                rope_theta=100000.0, max_position=8192, tie_embeddings=True, qkv_bias=False,
                                name="smollm2-135m"),
    "qwen2.5-coder-0.5b": ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                      n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, rms_eps=1e-6,
                                      rope_theta=1000000.0, max_position=32768, tie_embeddings=True,
                                      qkv_bias=True, name="qwen2.5-coder-0.5b"),
}
BACKENDS = ("torch", "triton", "cupy", "cuda")
CONTEXT = 512     # committed tokens the decode / draft / verify benchmarks attend to
TREE = 16         # verify-pass tokens
WINDOW = 32       # matchness context window (paper default)


def backend_ops(name: str) -> SimpleNamespace:
    """Op namespace for one backend on DEVICE, or pytest.skip with the reason it cannot run here."""
    from swiftk.runtime.ops import reference

    from swiftk.runtime.ops import OP_NAMES

    impl = {n: getattr(reference, n) for n in OP_NAMES}
    chosen = {n: "torch" for n in OP_NAMES}  # the runtime reads ops.backends (e.g. to pick the tree-mask path)

    def ns(label, extra=None, which=None):
        from swiftk.runtime.ops import namespace

        impl.update(extra or {})
        chosen.update({n: which for n in (extra or {})})
        return namespace(impl, chosen)

    if name == "torch":
        return ns("torch")
    if DEVICE.type != "cuda":
        pytest.skip(f"{name}: no CUDA device (the Triton interpreter on CPU is far too slow to benchmark)")
    from swiftk.runtime.ops import triton_ops

    ok, why = triton_ops.available()
    if name == "triton":
        if not ok:
            pytest.skip(f"triton unusable: {why}")
        return ns("triton", triton_ops.ops(), "triton")
    from swiftk.runtime.ops import cuda_ops, cupy_ops

    if name == "cupy":   # the same kernels/cuda/*.cu through NVRTC
        ok_c, why_c = cupy_ops.available()
        ext = cupy_ops.extension() if ok_c else None
    else:
        ok_c, why_c = cuda_ops.available()
        ext = None
    if not ok_c:
        pytest.skip(f"{name} unusable: {why_c}")
    if ok:
        ns("triton", triton_ops.ops(), "triton")
    return ns(name, cuda_ops.make_ops(fallback=dict(impl), ext=ext), name)


def random_tensors(cfg: ModelConfig, seed: int = 0) -> dict:
    """HF-named random weights for ``cfg`` (small values keep activations finite through many layers)."""
    g = torch.Generator().manual_seed(seed)
    D, hd, H, KV, I = cfg.hidden_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.intermediate_size

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    t = {"model.embed_tokens.weight": r(cfg.vocab_size, D), "model.norm.weight": torch.ones(D)}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = r(cfg.vocab_size, D)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(D)
        t[p + "post_attention_layernorm.weight"] = torch.ones(D)
        t[p + "self_attn.q_proj.weight"] = r(H * hd, D)
        t[p + "self_attn.k_proj.weight"] = r(KV * hd, D)
        t[p + "self_attn.v_proj.weight"] = r(KV * hd, D)
        t[p + "self_attn.o_proj.weight"] = r(D, H * hd)
        if cfg.qkv_bias:
            for n, m in (("q", H), ("k", KV), ("v", KV)):
                t[p + f"self_attn.{n}_proj.bias"] = r(m * hd)
        t[p + "mlp.gate_proj.weight"] = r(I, D)
        t[p + "mlp.up_proj.weight"] = r(I, D)
        t[p + "mlp.down_proj.weight"] = r(D, I)
    return t


_models: dict = {}


def get_model(shape: str, n_layers=None):
    """A random-weight Model (cached per shape/layer count; big shapes are slow to build)."""
    from dataclasses import replace

    from swiftk.runtime.model import Model

    key = (shape, n_layers)
    if key not in _models:
        if len(_models) >= 2:  # keep memory bounded: at most two models alive
            _models.pop(next(iter(_models)))
        cfg = SHAPES[shape] if n_layers is None else replace(SHAPES[shape], n_layers=n_layers)
        _models[key] = Model(cfg, random_tensors(cfg), device=DEVICE, dtype=torch.float32)
    return _models[key]


def skip_set_for(cfg: ModelConfig, ratio: float = 0.45) -> torch.Tensor:
    """A fixed skip set with ``ratio`` of the sublayers skipped, evenly spread (first/last layer never)."""
    eligible = list(range(2, 2 * cfg.n_layers - 2))
    k = int(round(ratio * 2 * cfg.n_layers))
    k = min(k, len(eligible))
    s = torch.zeros(2 * cfg.n_layers, dtype=torch.bool)
    for j in range(k):
        s[eligible[(j * len(eligible)) // max(k, 1)]] = True
    return s.to(DEVICE)


@pytest.fixture(params=BACKENDS)
def ops(request):
    return backend_ops(request.param)


@pytest.fixture(params=list(SHAPES))
def shape(request):
    return request.param


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
