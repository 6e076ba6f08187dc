"""The whole SWIFT greedy path with SWIFTK_BACKEND=triton (interpreter on CPU) gives the torch path's tokens."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# a GPU box without the interpreter: the engine here runs on CPU
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("runs Triton under the CPU interpreter (TRITON_INTERPRET=1); CUDA's Triton ops are test_gpu.py's",
                allow_module_level=True)
pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from swiftk.runtime import ops as ops_mod  # noqa: E402
from swiftk.runtime.config import from_hf_config  # noqa: E402
from swiftk.engine import Engine  # noqa: E402
from swiftk.loading.loaders import Checkpoint  # noqa: E402

from test_swift_sampling import _IdTokenizer  # noqa: E402


def _engine():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf = transformers.Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(10.0)
    ck = Checkpoint(config=from_hf_config(cfg.to_dict()), tensors=dict(hf.state_dict()), tokenizer=_IdTokenizer(),
                    identity={"name": "tiny-qwen2"})
    return Engine(ck, max_context=64, context_window=4, bayes_interval=2, max_opt_steps=6, bo_mode="sync",
                  max_tree_nodes=10, max_draft=4, eps=0.3, opt_budget=1.0, speculate="always", trace=True)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the interpreter runs one program at a time; extra threads only add contention
    yield
    torch.set_num_threads(n)


def test_swift_greedy_triton_equals_torch(monkeypatch):
    prompt = [5, 9, 2, 33, 17]
    monkeypatch.setenv("SWIFTK_BACKEND", "torch")
    ops_mod.clear_cache()
    eng_t = _engine()
    ar = eng_t.generate(prompt, max_new_tokens=16, method="autoregressive").token_ids
    ref = eng_t.generate(prompt, max_new_tokens=16, method="swift")
    assert ref.token_ids == ar
    monkeypatch.setenv("SWIFTK_BACKEND", "triton")
    ops_mod.clear_cache()
    try:
        eng_x = _engine()
        assert set(eng_x.model.ops.backends.values()) == {"triton"}
        out = eng_x.generate(prompt, max_new_tokens=16, method="swift")
    finally:
        ops_mod.clear_cache()
    assert out.token_ids == ar
    assert "optimize" in out.stats["phases"]
