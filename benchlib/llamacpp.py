"""llama.cpp as an optional peer (llama-cpp-python): the CPU engine people already use, on the same GGUF file.

It computes with the file's quantized blocks directly (Q4_1 / Q4_K ...), where swiftk de-quantizes them to its
compute dtype, so its greedy tokens may differ from transformers' and swiftk's: the bench reports its speed and its
token identity side by side, never as a losslessness check.

Not installed by the project (it builds from the sdist in ~10 min):
    CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" CXXFLAGS="$CFLAGS" pip install llama-cpp-python==0.3.36
(the AMX flags only matter on Intel CPUs with AMX inside a VM, where a native build dies with SIGILL).
"""
from __future__ import annotations

import time


def load_llamacpp(gguf_path, threads: int, n_ctx: int = 2048, prompt_lookup: int = 0):
    """(Llama, None) or (None, why it is unavailable). ``prompt_lookup`` > 0: llama-cpp-python's prompt-lookup
    speculation (``LlamaPromptLookupDecoding``, n-grams of the context up to 2 tokens by default) proposing that
    many tokens per step, verified by llama.cpp in one batch."""
    try:
        from llama_cpp import Llama
    except ImportError as e:
        return None, f"llama-cpp-python not installed ({e})"
    draft = None
    if prompt_lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup)
    try:
        llm = Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                    n_batch=512, verbose=False, draft_model=draft)
    except Exception as e:  # noqa: BLE001 -- any load failure makes the peer unavailable, with the reason
        return None, f"llama.cpp cannot load {gguf_path}: {e}"
    return llm, None


def llamacpp_run(llm, ids: list, max_new: int, eos_ids) -> dict:
    """Greedy generation from token ids (prefill included in the wall time, no prompt cache reuse), stopping on
    any of ``eos_ids`` like swiftk does."""
    stop = set(eos_ids)
    llm.reset()
    out = []
    t0 = time.perf_counter()
    for tok in llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if tok in stop or len(out) >= max_new:
            break
    wall = time.perf_counter() - t0
    return {"token_ids": out, "wall_time_s": wall, "new_tokens": len(out)}
