"""A model swiftk can load, written as a Hugging Face directory (config.json, model.safetensors, tokenizer files),
so that engines reading that format (vLLM, transformers) run the same model: GGUF blocks are de-quantized to
float32 (or bfloat16/float16), LLaMA's Q/K rows come out in Hugging Face's order, the tokenizer keeps its
vocabulary, specials and chat template. ``swiftk export-hf MODEL OUT``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Union

import torch

from ..errors import SwiftkError
from ..loading.loaders import load_checkpoint
from ..loading.registry import resolve_model

DTYPES = ("float32", "bfloat16", "float16")
_ARCH_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def hf_config(cfg, tokenizer, dtype: str) -> dict:
    """config.json for a ModelConfig (swiftk.runtime.config) and its tokenizer."""
    if cfg.rope_freq_factors is not None and cfg.rope_scaling is None:
        raise SwiftkError("this model's RoPE frequency factors (a LLaMA-3.1 GGUF's rope_freqs) have no Hugging Face "
                          "config field: export from the original Hugging Face directory instead")
    out = {
        "architectures": [_ARCH_CLASS[cfg.arch]],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": dtype,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "_name_or_path": cfg.name,
    }
    if cfg.arch == "llama":
        out["attention_bias"] = bool(cfg.qkv_bias)
        out["mlp_bias"] = False
    elif not cfg.qkv_bias:   # Qwen2's classes always carry Q/K/V biases
        raise SwiftkError("a qwen2 model without Q/K/V biases cannot be written as a Hugging Face qwen2 config")
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                               "high_freq_factor": rs.high_freq_factor,
                               "original_max_position_embeddings": rs.original_max_position}
    return out


def export_hf(model: Union[str, os.PathLike], out_dir: Union[str, os.PathLike], dtype: str = "float32",
              overwrite: bool = False) -> Path:
    """Write ``model`` (registry name, .gguf file or HF directory) as a Hugging Face directory ``out_dir``. Built
    under a temporary name next to it and renamed when complete: an interrupted export leaves nothing behind."""
    from safetensors.torch import save_file   # lazy: safetensors, needed only when writing

    if dtype not in DTYPES:
        raise SwiftkError(f"export dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out_dir).expanduser()
    if out.exists() and not overwrite:
        raise SwiftkError(f"{out} exists: choose a new folder or pass overwrite=True (--overwrite)")
    if out.exists() and not out.is_dir():
        raise SwiftkError(f"{out} exists and is not a folder")
    ck = load_checkpoint(resolve_model(model), torch.float32)
    cfg = hf_config(ck.config, ck.tokenizer, dtype)
    tdtype = getattr(torch, dtype)
    tensors = {k: v.to(tdtype).contiguous() for k, v in ck.tensors.items()}
    if not ck.config.tie_embeddings and "lm_head.weight" not in tensors:
        raise SwiftkError("the model has an untied LM head but no lm_head.weight was loaded")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        files = ck.tokenizer.hf_files()
        (tmp / "tokenizer.json").write_text(files["tokenizer.json"], encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(files["tokenizer_config.json"], indent=1) + "\n")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        gen = {"bos_token_id": ck.tokenizer.bos_id, "eos_token_id": sorted(ck.tokenizer.eos_ids) or None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
