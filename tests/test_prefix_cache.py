"""prefix_cache: a call reuses the KV cache the engine's previous call left for the part of the prompt it shares (a
chat's earlier turns). The output is the one a whole prefill gives (greedy and seeded sampling, plain and
speculative decoding, checked against a second engine that prefills everything); anything that restarted the cache
in between, a call that failed, or prefix_cache=False turns the reuse off."""
import pytest
import torch

import swiftk
from swiftk.errors import SwiftkError
from swiftk.runtime.ops import cpu_layers


@pytest.fixture(scope="module")
def engs(smollm2_path):
    """(an engine that reuses, an engine that prefills every prompt whole): the product's default weights."""
    return swiftk.load(str(smollm2_path)), swiftk.load(str(smollm2_path))


def _second_turn(eng) -> list:
    q = "Name three prime numbers and say why each is prime."
    first = eng.generate(q, max_new_tokens=24, chat=True)
    return [{"role": "user", "content": q}, {"role": "assistant", "content": first.text},
            {"role": "user", "content": "Now name three even numbers."}]


@pytest.mark.parametrize("method", ["autoregressive", "swift"])
def test_a_second_turn_reuses_the_first_and_decodes_the_same(engs, method):
    eng, fresh = engs
    msgs = _second_turn(eng)
    got = eng.generate(msgs, max_new_tokens=32, chat=True, method=method)
    want = fresh.generate(msgs, max_new_tokens=32, chat=True, method=method, prefix_cache=False)
    assert want.stats.prompt_reused == 0
    assert got.stats.prompt_reused >= 30, got.stats.prompt_reused   # the first turn's prompt and answer
    assert got.stats.prompt_reused < got.stats.prompt_tokens
    assert got.token_ids == want.token_ids


def test_seeded_sampling_is_unchanged_by_reuse(engs):
    eng, fresh = engs
    p = "Once upon a time, in a small village by the sea, there lived"
    eng.generate(p, max_new_tokens=8, method="autoregressive")
    kw = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=11)
    got = eng.generate(p + " an old fisherman who", **kw)
    want = fresh.generate(p + " an old fisherman who", prefix_cache=False, **kw)
    assert got.stats.prompt_reused > 5 and got.token_ids == want.token_ids


def test_the_same_prompt_again_prefills_only_its_last_token(engs):
    eng, _ = engs
    p = "def fibonacci(n):"
    a = eng.generate(p, max_new_tokens=12, method="autoregressive")
    b = eng.generate(p, max_new_tokens=12, method="autoregressive")
    assert b.stats.prompt_reused == b.stats.prompt_tokens - 1
    assert b.token_ids == a.token_ids


def test_no_reuse_after_a_restart_a_failure_or_when_off(engs):
    eng, _ = engs
    p = "The three laws of motion are"
    r = eng.generate(p, max_new_tokens=8, method="autoregressive")
    eng.logits(r.prompt_ids + r.token_ids)   # a whole-sequence pass restarts the cache
    assert eng.generate(p, max_new_tokens=8, method="autoregressive").stats.prompt_reused == 0
    assert eng.generate(p, max_new_tokens=8, prefix_cache=False).stats.prompt_reused == 0

    def boom(piece):
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        eng.generate(p, max_new_tokens=8, callback=boom)
    again = eng.generate(p, max_new_tokens=8, method="autoregressive")
    assert again.stats.prompt_reused == 0 and again.token_ids == r.token_ids


def test_a_cache_keeps_only_what_it_holds(engs):
    eng, _ = engs
    cache = eng.model.new_cache(8)
    cache.advance(3)
    epoch = cache.epoch
    cache.truncate(2)
    assert cache.length == 2 and cache.epoch == epoch
    with pytest.raises(SwiftkError, match="cannot keep 5 of 2"):
        cache.truncate(5)
    cache.reset()
    assert cache.length == 0 and cache.epoch == epoch + 1


def test_refused_where_a_prefill_is_not_held_to_decoding(engs, monkeypatch):
    """On CUDA a prefill's rows are not held bit-identical to decoding's: asking for reuse there is refused, not
    ignored; the default (reuse where exact) prefills whole there."""
    eng, _ = engs
    monkeypatch.setattr(eng.model, "device", torch.device("cuda"))
    with pytest.raises(SwiftkError, match="prefix_cache=True cannot be exact here: on cuda"):
        eng.generate("hello", max_new_tokens=2, prefix_cache=True)


def test_no_reuse_off_the_fused_layer_loop(engs):
    """Off the CPU's fused layer loop long passes take a GEMM path of their own: the default reuses nothing there
    (nor records what such a call left), an explicit prefix_cache=True is refused."""
    eng, _ = engs
    p = "A list of the planets of the solar system, in order:"
    try:
        cpu_layers.set_fused(False)
        eng.generate(p, max_new_tokens=6, method="autoregressive")
        assert eng.generate(p, max_new_tokens=6, method="autoregressive").stats.prompt_reused == 0
        with pytest.raises(SwiftkError, match="fused C layer loop"):
            eng.generate(p, max_new_tokens=6, prefix_cache=True)
    finally:
        cpu_layers.set_fused(True)
    assert eng.generate(p, max_new_tokens=6, method="autoregressive").stats.prompt_reused == 0   # nothing recorded
    assert eng.generate(p, max_new_tokens=6, method="autoregressive").stats.prompt_reused > 0
