"""Reduced-vocabulary draft head (swiftk.proposers.draft_head): subset logits, growth, frequent-id ranking and its cache."""
import json

import pytest
import torch

from swiftk.errors import SwiftkError
from swiftk.runtime.model import linear
from swiftk.proposers.draft_head import DraftHead, frequent_token_ids

V, D = 1000, 64


@pytest.fixture
def head():
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, D, generator=g)


@pytest.mark.parametrize("T", [1, 3])  # linear() takes a different matmul form for T = 1 and T > 1
def test_logits_subset_matches_full_head(head, T):
    base = torch.tensor([5, 17, 999, 0, 400])
    dh = DraftHead(head, base, capacity=16)
    x = torch.randn(T, D)
    full = linear(x, head).float()
    sub = dh.logits_subset(x)
    assert sub.dtype == torch.float32 and sub.shape == (T, len(dh.ids))
    assert torch.equal(torch.sort(dh.ids).values, torch.sort(base).values)
    assert torch.allclose(sub, full[:, dh.ids], rtol=1e-5, atol=1e-5)


def test_logits_full_is_masked(head):
    dh = DraftHead(head, torch.tensor([3, 1, 4, 15, 9, 2, 6]), capacity=8)
    x = torch.randn(2, D)
    out = dh.logits_full(x)
    assert out.shape == (2, V) and out.dtype == torch.float32
    inside = torch.zeros(V, dtype=torch.bool)
    inside[dh.ids] = True
    assert torch.isneginf(out[:, ~inside]).all()
    assert torch.allclose(out[:, inside], linear(x, head).float()[:, inside], rtol=1e-5, atol=1e-5)
    # Sampling from it never picks a token outside the subset.
    picks = torch.multinomial(torch.softmax(out, -1), 200, replacement=True)
    assert inside[picks].all()


def test_add_new_then_old_ids(head):
    dh = DraftHead(head, torch.tensor([10, 20, 30]), capacity=8)
    dh.add([40, 10, 40, 50])  # 10 is already in; 40 twice takes one slot
    assert sorted(dh.ids.tolist()) == [10, 20, 30, 40, 50]
    before = dh.ids.clone()
    dh.add([50, 20])
    dh.add(torch.tensor([30]))
    dh.add([])
    assert torch.equal(dh.ids, before)
    x = torch.randn(1, D)
    assert torch.allclose(dh.logits_subset(x), linear(x, head).float()[:, dh.ids], rtol=1e-5, atol=1e-5)


def test_capacity_overflow(head):
    with pytest.raises(SwiftkError):
        DraftHead(head, torch.arange(10), capacity=9)
    dh = DraftHead(head, torch.arange(8), capacity=10)
    dh.add([1, 2, 8, 9])  # exactly fills it
    with pytest.raises(SwiftkError):
        dh.add([100])
    assert len(dh.ids) == 10  # a refused add() leaves the subset as it was
    with pytest.raises(SwiftkError):
        dh.add([V])


def test_nbytes(head):
    dh = DraftHead(head, torch.arange(4), capacity=100)
    assert dh.nbytes() >= 100 * D * 4


class ByteTokenizer:
    """A tiny stand-in: one token per byte, so the corpus pass is fast."""

    vocab_size = 300
    eos_ids = {299}
    bos_id = 298
    special_ids = {298, 299}

    def encode(self, text, add_bos=False):
        return list(text.encode("utf-8"))


def test_frequent_ids_corrupt_cache_is_rebuilt(tmp_path):
    tok = ByteTokenizer()
    a = frequent_token_ids(tok, 200, cache_dir=tmp_path, model_name="byte/tok")
    (cache,) = (tmp_path / "draft_vocab").glob("*.json")
    assert a[:2].tolist() == [298, 299] and len(set(a.tolist())) == 200
    assert a[2].item() == ord(" ")  # the most frequent byte of Python source
    cache.write_text('{"fingerprint": ')  # truncated
    assert torch.equal(frequent_token_ids(tok, 200, cache_dir=tmp_path, model_name="byte/tok"), a)
    json.loads(cache.read_text())  # rewritten whole
    with pytest.raises(SwiftkError):
        frequent_token_ids(tok, 301, cache_dir=tmp_path)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    # Tokenizer only, from the GGUF metadata: skips dequantizing the weights.
    from swiftk.loading.loaders import read_gguf
    from swiftk.loading.tokenizer import Tokenizer

    meta = read_gguf(smollm2_path).metadata
    return Tokenizer.from_gguf_metadata({k: v for k, v in meta.items() if k.startswith("tokenizer.")})


def test_frequent_ids_smollm2(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    ids = frequent_token_ids(tok, 8192, cache_dir=tmp_path, model_name="smollm2-135m")
    assert ids.dtype == torch.long and ids.shape == (8192,)
    assert len(set(ids.tolist())) == 8192
    assert 0 <= int(ids.min()) and int(ids.max()) < tok.vocab_size
    assert set(tok.eos_ids) <= set(ids.tolist())
    assert (tmp_path / "draft_vocab" / "smollm2-135m.json").is_file()
    again = frequent_token_ids(tok, 8192, cache_dir=tmp_path, model_name="smollm2-135m")  # from the cache
    assert torch.equal(ids, again)
    # A smaller size is a prefix of the same ranking.
    assert torch.equal(frequent_token_ids(tok, 1000, cache_dir=tmp_path, model_name="smollm2-135m"), ids[:1000])
    # Common code and text tokens make the cut.
    for piece in ["Ġself", "Ġreturn", "Ġthe", "Ġand"]:
        assert tok.token_to_id(piece) in set(ids.tolist())


def test_the_draft_head_is_built_at_load_not_inside_a_call(tiny_dir, monkeypatch):
    """The draft head's token ranking (~1 s on a fresh $SWIFTK_HOME) runs when the engine loads: a user's first
    generate must not wait for it (issue 45's first-call stall)."""
    import swiftk
    import swiftk.proposers.draft_head as dh

    calls = []
    real = dh.frequent_token_ids
    monkeypatch.setattr(dh, "frequent_token_ids", lambda *a, **k: calls.append(1) or real(*a, **k))
    eng = swiftk.load(str(tiny_dir), persist=False, draft_vocab=8)
    assert len(calls) == 1
    eng.generate("hello", max_new_tokens=4)
    assert len(calls) == 1
