"""The CUDA-graph pass body (swiftk/runtime/graphs.py) run eagerly on the CPU: the device-built mask, the bucket padding and
the slot arithmetic must give the logits of the ordinary pass. The replay itself is tested on a GPU (test_gpu.py)."""
import pytest
import torch

import swiftk
from swiftk.errors import SwiftkError
from swiftk.runtime.graphs import _bucket_T, _Graph
from swiftk.runtime.ops.masks import TreeMask


@pytest.fixture(scope="module")
def eng(tiny_dir):
    return swiftk.load(str(tiny_dir), device="cpu", dtype="float32")


def _prefill(eng, n):
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(3, eng.config.vocab_size, (n,), generator=g)
    ar = torch.arange(n)
    eng.model.forward(ids, ar, ar, eng.cache)
    eng.cache.reset()
    eng.cache.advance(n)
    return ids


@pytest.mark.parametrize("T,skip", [(1, None), (1, "skip"), (3, None), (5, "skip"), (8, None)])
def test_graph_body_equals_the_eager_pass(eng, T, skip):
    m, cache = eng.model, eng.cache
    n = 37
    _prefill(eng, n)
    skip = eng.states.from_layers(attention=[1, 3], mlp=[2]) if skip else None
    g = torch.Generator().manual_seed(T)
    toks = torch.randint(3, eng.config.vocab_size, (T,), generator=g)
    anc = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):           # a random tree: each node under a random earlier one
        anc[i] |= anc[int(torch.randint(0, i, (1,), generator=g))]
    depth = anc.sum(1) - 1
    pos, slots = n + depth, torch.arange(n, n + T)
    ref = m.forward(toks, pos, slots, cache, attn_mask=TreeMask.of(n, anc), skip=skip)
    Tb = _bucket_T(T)
    body = _Graph(m, cache, Tb, skip, with_logits=True)
    body.fill(toks, pos, n, anc if T > 1 else None)
    with torch.inference_mode():
        x, logits = body._run()
    torch.testing.assert_close(logits[:T], ref, rtol=1e-5, atol=1e-5)


def test_single_token_start_equals_slots_causal(eng):
    m, cache = eng.model, eng.cache
    n = 20
    _prefill(eng, n)
    pos = torch.tensor([n])
    a = m.forward(torch.tensor([5]), pos, pos, cache)
    b = m.forward(torch.tensor([5]), pos, pos, cache, start=n)
    assert torch.equal(a, b)
    with pytest.raises(SwiftkError, match="single token"):
        m.forward(torch.tensor([5, 6]), torch.arange(n, n + 2), torch.arange(n, n + 2), cache, start=n)


def test_cuda_graphs_option_is_applied_or_rejected(tiny_dir):
    with pytest.raises(SwiftkError, match="needs a CUDA device"):
        swiftk.load(str(tiny_dir), device="cpu", cuda_graphs=True)
    with pytest.raises(SwiftkError, match="cuda_graphs must be"):
        swiftk.load(str(tiny_dir), device="cpu", cuda_graphs="yes")
    e = swiftk.load(str(tiny_dir), device="cpu", cuda_graphs=False)
    assert e.model.graphs is None and e.info()["cuda_graphs"] is None
