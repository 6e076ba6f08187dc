"""Hugging Face transformers baselines, run on the same weights as swiftk.

The model is loaded from the same GGUF file swiftk reads (transformers de-quantizes it to ``dtype``), so the
comparison differs only in the decoding engine. Methods, all greedy and lossless with respect to plain greedy:

- ``greedy``: plain autoregressive ``generate``.
- ``early_exit``: transformers' self-speculative decoding (``assistant_early_exit=E``): the first E layers plus the
  final norm and LM head draft, the full model verifies. The model's decoder must honour
  ``config.num_hidden_layers`` when running its layer stack (LLaMA and Qwen2 do); otherwise
  ``HFMethodUnsupported`` is raised rather than silently drafting with every layer.
- ``prompt_lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens=10``), n-gram drafts copied from the
  context.

``python -m bench.hf_baselines [GGUF]`` prints tokens/s of each method on two HumanEval prompts.
"""
from __future__ import annotations

import inspect
import operator
import time
from pathlib import Path

from swiftk.errors import SwiftkError

METHODS = ("greedy", "early_exit", "prompt_lookup")
DEFAULT_EARLY_EXIT_FRACTION = 0.5  # of the layers, when the caller gives no E
PROMPT_LOOKUP_TOKENS = 10


class HFMethodUnsupported(SwiftkError):
    """This transformers method cannot run on this model; benches report it as "n/a"."""


def _torch_dtype(dtype):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise SwiftkError(f"unknown dtype {dtype!r}; use one of {', '.join(table)}")
    return table[dtype]


def load_hf(gguf_path, dtype="float32", device="cpu"):
    """``(model, tokenizer)`` from a GGUF file via transformers' GGUF loader (needs `gguf` and `accelerate`)."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise SwiftkError(f"GGUF file not found: {path}")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise SwiftkError("the Hugging Face baselines need `transformers` (and `gguf`, `accelerate`)") from e
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=_torch_dtype(dtype))
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ImportError, ValueError) as e:  # missing gguf/accelerate, or an architecture transformers can't map
        raise SwiftkError(f"transformers could not load {path}: {e}") from e
    model.to(device).eval()
    return model, tokenizer


def early_exit_supported(model) -> bool:
    """Whether the decoder truncates its layer stack to ``config.num_hidden_layers`` (what early exit relies on)."""
    base = getattr(model, model.base_model_prefix, None)
    if base is None:
        return False
    try:
        src = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return "num_hidden_layers]" in src


def _generation_config(model, max_new_tokens: int, method: str, kw: dict):
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    # A plain config built here (not the model's), so no sampling knobs, min lengths or repetition penalties leak in.
    cfg = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
               pad_token_id=pad if pad is not None else eos, use_cache=True)
    if method == "early_exit":
        n_layers = model.config.num_hidden_layers
        e = kw.get("early_exit_layers", kw.get("assistant_early_exit"))
        e = max(1, int(n_layers * DEFAULT_EARLY_EXIT_FRACTION)) if e is None else int(e)
        if not 1 <= e < n_layers:
            raise SwiftkError(f"early_exit_layers must be in [1, {n_layers - 1}], got {e}")
        if not early_exit_supported(model):
            raise HFMethodUnsupported(
                f"{type(model).__name__}: its decoder ignores config.num_hidden_layers, so transformers' "
                "assistant_early_exit would draft with every layer")
        cfg["assistant_early_exit"] = e
    elif method == "prompt_lookup":
        cfg["prompt_lookup_num_tokens"] = int(kw.get("prompt_lookup_num_tokens", PROMPT_LOOKUP_TOKENS))
    elif method != "greedy":
        raise SwiftkError(f"unknown HF method {method!r}; use one of {', '.join(METHODS)}")
    return GenerationConfig(**cfg)


def hf_generate(model, input_ids, max_new_tokens: int, method: str = "greedy", **kw) -> dict:
    """Greedy-decode up to ``max_new_tokens`` after ``input_ids`` (stops at eos) with one HF method.

    Returns ``dict(token_ids=[new tokens only], wall_time_s, new_tokens)``; the time covers ``generate`` alone.
    Keyword options: ``early_exit_layers`` (alias ``assistant_early_exit``) for ``early_exit``;
    ``prompt_lookup_num_tokens`` for ``prompt_lookup``.
    """
    import torch

    try:
        ids = [operator.index(t) for t in input_ids]
    except TypeError:
        ids = None
    if not ids or min(ids) < 0:
        raise SwiftkError("input_ids must be a non-empty list of non-negative ints")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SwiftkError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    gen_cfg = _generation_config(model, max_new_tokens, method, kw)
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    attn = torch.ones_like(x)
    cuda = device.type == "cuda"
    with torch.inference_mode():
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        try:
            out = model.generate(x, attention_mask=attn, generation_config=gen_cfg)
        except (NotImplementedError, ValueError, AttributeError) as e:
            if method == "greedy":
                raise
            raise HFMethodUnsupported(f"transformers {method} failed on {type(model).__name__}: {e}") from e
        if cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    return {"token_ids": new, "wall_time_s": dt, "new_tokens": len(new)}


def _main(argv=None) -> int:
    import argparse

    import torch

    from benchlib.workloads import humaneval

    ap = argparse.ArgumentParser(description="tokens/s of each HF baseline method on a few HumanEval prompts")
    ap.add_argument("gguf", nargs="?", default="/tmp/smollm2.gguf")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--early-exit-layers", type=int, default=None)
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    model, tok = load_hf(a.gguf, a.dtype, a.device)
    print(f"loaded {a.gguf} ({type(model).__name__}, {model.config.num_hidden_layers} layers) "
          f"on {a.device} in {time.perf_counter() - t0:.1f}s")
    prompts = [tok.encode(p["turns"][0]) for p in humaneval(a.prompts)]
    hf_generate(model, prompts[0], 4, "greedy")  # warm-up: first call pays one-off setup
    ref = None
    for method in METHODS:
        try:
            runs = [hf_generate(model, ids, a.max_new_tokens, method, early_exit_layers=a.early_exit_layers)
                    for ids in prompts]
        except HFMethodUnsupported as e:
            print(f"{method:14s} n/a ({e})")
            continue
        toks = sum(r["new_tokens"] for r in runs)
        secs = sum(r["wall_time_s"] for r in runs)
        outs = [r["token_ids"] for r in runs]
        ref = outs if ref is None else ref
        same = "identical to greedy" if outs == ref else "DIFFERS from greedy"
        print(f"{method:14s} {toks / secs:8.1f} tok/s  ({toks} tokens in {secs:.2f}s, {same})")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
