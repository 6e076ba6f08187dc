"""Microbenchmarks (pytest-benchmark): ops, one decoder layer, and the pieces of a SWIFT round.

    pytest bench/ --benchmark-only                 # every backend usable here x every shape
    pytest bench/ --benchmark-only -k small        # quick CPU run (< 1 min)

Parametrized by backend (torch always; triton / cuda only with a CUDA device) and by model shape (random weights
built from the real models' ModelConfig, no download). These are timings, not tests: each checks only that the
output has the right shape, so a broken op fails loudly instead of being timed.
"""
from __future__ import annotations

import pytest
import torch

from bench.conftest import CONTEXT, DEVICE, SHAPES, TREE, WINDOW, get_model, skip_set_for, sync


def _bench(benchmark, fn, *args, **kw):
    """Time ``fn`` with the device synchronised after each call (GPU work is asynchronous)."""
    def call():
        out = fn(*args, **kw)
        sync()
        return out

    return benchmark(call)


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def _chain_and_siblings(T: int) -> torch.Tensor:
    """Ancestor mask [T, T] of a SWIFT-like tree: a spine of T//2 nodes with one sibling hanging off each."""
    parents = [-1]
    spine = T // 2
    for j in range(1, spine):
        parents.append(j - 1)
    while len(parents) < T:
        parents.append((len(parents) - spine) % spine)
    anc = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return anc.to(DEVICE)


# ---------------------------------------------------------------- ops


@pytest.mark.parametrize("T", [1, TREE])
def test_rmsnorm(benchmark, ops, shape, T):
    D = SHAPES[shape].hidden_size
    x, w = _rand(T, D), _rand(D)
    out = _bench(benchmark, ops.rmsnorm, x, w, 1e-6)
    assert out.shape == (T, D)


@pytest.mark.parametrize("T", [1, TREE])
def test_fused_add_rmsnorm(benchmark, ops, shape, T):
    D = SHAPES[shape].hidden_size
    d, r, w = _rand(T, D), _rand(T, D), _rand(D)
    out, res = _bench(benchmark, ops.fused_add_rmsnorm, d, r, w, 1e-6, None)
    assert out.shape == res.shape == (T, D)


@pytest.mark.parametrize("T", [1, TREE])
def test_rope(benchmark, ops, shape, T):
    from swiftk.runtime.config import rope_inv_freq

    c = SHAPES[shape]
    x = _rand(T, c.n_heads, c.head_dim)
    pos = torch.arange(CONTEXT, CONTEXT + T, device=DEVICE)
    inv = rope_inv_freq(c, device=DEVICE).float()
    out = _bench(benchmark, ops.apply_rope, x, pos, inv)
    assert out.shape == x.shape


def test_attention_decode(benchmark, ops, shape):
    c = SHAPES[shape]
    q = _rand(1, c.n_heads, c.head_dim)
    k, v = _rand(c.n_kv_heads, CONTEXT, c.head_dim), _rand(c.n_kv_heads, CONTEXT, c.head_dim)
    mask = torch.ones(1, CONTEXT, dtype=torch.bool, device=DEVICE)
    out = _bench(benchmark, ops.attention, q, k, v, mask, c.head_dim ** -0.5)
    assert out.shape == q.shape


def test_attention_tree(benchmark, ops, shape):
    from swiftk.runtime.ops.reference import pack_tree_mask

    c = SHAPES[shape]
    q = _rand(TREE, c.n_heads, c.head_dim)
    S = CONTEXT + TREE + 16
    k, v = _rand(c.n_kv_heads, S, c.head_dim), _rand(c.n_kv_heads, S, c.head_dim)
    bits = pack_tree_mask(_chain_and_siblings(TREE))
    out = _bench(benchmark, ops.tree_attention, q, k, v, CONTEXT, bits, c.head_dim ** -0.5)
    assert out.shape == q.shape


def test_kv_commit(benchmark, ops, shape):
    c = SHAPES[shape]
    cache = torch.zeros(c.n_layers, 2, c.n_kv_heads, CONTEXT + 64, c.head_dim, device=DEVICE)
    # an accepted path that left the spine: root, two spine nodes, then siblings further down the tree
    src = torch.tensor([0, 1, 2, 9, 12, 14], device=DEVICE) + CONTEXT
    dst = torch.arange(CONTEXT, CONTEXT + src.numel(), device=DEVICE)
    _bench(benchmark, ops.kv_commit, cache, src, dst)


# ---------------------------------------------------------------- model pieces


def _model(shape, ops, n_layers=None):
    m = get_model(shape, n_layers)
    m.ops = ops  # the Model calls every op through this namespace
    cache = m.new_cache(CONTEXT + 128)
    cache.reset()
    cache.advance(CONTEXT)
    return m, cache


def test_decoder_layer(benchmark, ops, shape):
    """One decoder layer at decode (T=1): a 1-layer model with no logits rows computed."""
    m, cache = _model(shape, ops, n_layers=1)
    tok = torch.zeros(1, dtype=torch.long, device=DEVICE)
    pos = torch.tensor([CONTEXT], device=DEVICE)
    none = torch.zeros(0, dtype=torch.long, device=DEVICE)
    out = _bench(benchmark, m.forward, tok, pos, pos, cache, logits_idx=none)
    assert out.shape[0] == 0


def test_decode_step(benchmark, ops, shape):
    """One autoregressive step of the full model (all layers + LM head) after CONTEXT tokens."""
    m, cache = _model(shape, ops)
    tok = torch.zeros(1, dtype=torch.long, device=DEVICE)
    pos = torch.tensor([CONTEXT], device=DEVICE)
    out = _bench(benchmark, m.forward, tok, pos, pos, cache)
    assert out.shape == (1, m.cfg.vocab_size)


def test_draft_step(benchmark, ops, shape):
    """One SWIFT draft step: the full model with 45% of its sublayers skipped."""
    m, cache = _model(shape, ops)
    skip = skip_set_for(m.cfg)
    tok = torch.zeros(1, dtype=torch.long, device=DEVICE)
    pos = torch.tensor([CONTEXT], device=DEVICE)
    out = _bench(benchmark, m.forward, tok, pos, pos, cache, skip=skip)
    assert out.shape == (1, m.cfg.vocab_size)


def test_verify_pass(benchmark, ops, shape):
    """One verify pass over a TREE-node token tree (tree attention mask) after CONTEXT tokens."""
    from swiftk.runtime.model import TreeMask
    from swiftk.runtime.ops.reference import pack_tree_mask

    m, cache = _model(shape, ops)
    anc = _chain_and_siblings(TREE)
    depth = anc.sum(1) - 1
    toks = torch.zeros(TREE, dtype=torch.long, device=DEVICE)
    slots = torch.arange(CONTEXT, CONTEXT + TREE, device=DEVICE)
    mask = TreeMask(CONTEXT, pack_tree_mask(anc))
    out = _bench(benchmark, m.forward, toks, CONTEXT + depth, slots, cache, attn_mask=mask)
    assert out.shape == (TREE, m.cfg.vocab_size)


def test_optimization_step(benchmark, ops, shape):
    """One optimization step's cost: the teacher-forced matchness forward over the last WINDOW tokens."""
    from swiftk.proposers.draft_loop import matchness

    m, cache = _model(shape, ops)
    skip = skip_set_for(m.cfg)
    window = list(range(1, WINDOW + 1))
    score = _bench(benchmark, matchness, m, cache, window, 7, skip)
    assert 0.0 <= score <= 1.0


# ---------------------------------------------------------------- GGUF block matmuls (CPU)

QUANT_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the block kernels are CPU kernels")
@pytest.mark.parametrize("act", ["float32", "int8"])
@pytest.mark.parametrize("rows", [1, 4, 8, 16])
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_quant_linear(benchmark, fmt, rows, act):
    """y = x @ W.T on GGUF blocks (1536 x 1536, random blocks), float32 or int8 activations: the cost of a decode
    step's (rows=1) and a verify pass's matmuls per format; the int8 / float32 ratio at rows 8 is what makes a verify
    pass cheap."""
    import numpy as np

    from bench.quant_linear import _random_blocks
    from swiftk.runtime.ops import cpu_quant

    if not cpu_quant.available():
        pytest.skip(cpu_quant.status())
    K = N = 1536
    w = _random_blocks(fmt, N, K, np.random.default_rng(0))
    x = torch.randn(rows, K)
    out = benchmark(cpu_quant.linear, x, w, cpu_quant.TYPES[fmt], K, act)
    assert out.shape == (rows, N)
