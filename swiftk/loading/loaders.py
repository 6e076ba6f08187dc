"""Checkpoint loading: a GGUF file or a Hugging Face directory -> config, HF-named tensors, tokenizer.

Every loader returns tensors under Hugging Face names and layout ([out, in] weights, Q/K rows in
HF's rotate-half order), on CPU, in the requested dtype, checked against the config's shapes.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..runtime.config import ModelConfig, from_hf_config
from ..errors import SwiftkError
from ..files import read_json, regular_file
from .tokenizer import Tokenizer
from ..runtime import hugepages
from ..runtime.ops import cpu_quant
from ..runtime.ops.cpu_quant import TYPES
from ..runtime.weights import BlockWeight

from .gguf import (_BLK, GGUFFile, GGUFTensor, _check_shape, _dequantize, _gguf_config, _hf_to_gguf_name,  # noqa: F401
                        _numpy_shape, _supported_qtypes, _unpermute, gguf_to_hf_name, read_blocks, read_gguf)


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict  # HF name -> torch.Tensor (CPU, requested dtype)
    tokenizer: Tokenizer
    identity: dict  # name, path, fingerprint, arch, n_layers: tags results (e.g. saved skip sets)
    native: bool = False  # matrices kept in GGUF blocks (load_checkpoint(native=...))


def load_checkpoint(path, dtype: torch.dtype = torch.float32, native=False, pack: bool = False) -> Checkpoint:
    """Load a ``.gguf`` file or a Hugging Face model directory. ``native``: a GGUF file's block-format matrices
    stay in their blocks (weights.BlockWeight), everything else is converted to ``dtype``; "auto": so when the
    file's layer matrices are block formats (``Checkpoint.native`` says what was done). ``pack``: block matrices
    are packed for the int8-activation kernel as they are read (in place: no second copy of the model)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise SwiftkError(f"model path not found: {p}")
    if p.is_dir():
        if (p / "config.json").is_file():
            return _load_hf_dir(p, dtype)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype, native, pack)
        raise SwiftkError(f"{p} is not a Hugging Face model directory (no config.json) and holds no single .gguf file")
    regular_file(p, "model file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise SwiftkError(f"{p} is not a GGUF file (magic {magic!r}) and not a Hugging Face directory")
    return _load_gguf(p, dtype, native, pack)


# ---------------------------------------------------------------------------------------------
# shared: expected tensor shapes
# ---------------------------------------------------------------------------------------------
def expected_shapes(cfg: ModelConfig) -> dict:
    """HF tensor name -> shape, for every tensor the runtime needs."""
    D, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    s = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        s["lm_head.weight"] = (V, D)
    for i in range(cfg.n_layers):
        b = f"model.layers.{i}."
        s[b + "input_layernorm.weight"] = (D,)
        s[b + "self_attn.q_proj.weight"] = (q, D)
        s[b + "self_attn.k_proj.weight"] = (kv, D)
        s[b + "self_attn.v_proj.weight"] = (kv, D)
        s[b + "self_attn.o_proj.weight"] = (D, q)
        if cfg.qkv_bias:
            s[b + "self_attn.q_proj.bias"] = (q,)
            s[b + "self_attn.k_proj.bias"] = (kv,)
            s[b + "self_attn.v_proj.bias"] = (kv,)
        s[b + "post_attention_layernorm.weight"] = (D,)
        s[b + "mlp.gate_proj.weight"] = (I, D)
        s[b + "mlp.up_proj.weight"] = (I, D)
        s[b + "mlp.down_proj.weight"] = (D, I)
    return s


def check_layer_count(n_layers: int, names, layer_re: re.Pattern, field: str, where: str) -> None:
    """The config's layer count must match the layer tensors present; checked before anything per layer is built.

    ``layer_re`` matches a layer tensor's name with the layer index as group 1. A count above what the file
    holds (say block_count 0xFFFFFFFF) would have expected_shapes() list billions of names; a count below it
    would silently drop the last layers and change every output.
    """
    by_layer = {}
    for n in names:
        m = layer_re.match(n)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append(n)
    top = max(by_layer, default=-1) + 1  # the file cannot hold more than layers 0..top-1
    if n_layers > top:
        held = f"only layers 0..{top - 1}" if top else "no layers"
        raise SwiftkError(f"{where}: {field} is {n_layers} but the file has tensors for {held}")
    unused = [n for i in sorted(by_layer) if i >= n_layers for n in sorted(by_layer[i])]
    if unused:
        shown = ", ".join(unused[:4]) + (f" (and {len(unused) - 4} more)" if len(unused) > 4 else "")
        raise SwiftkError(f"{where}: {field} is {n_layers} but the file also has tensors for layers "
                          f"{n_layers}..{top - 1}, which would be left unused: {shown}")


def _check_weights(name: str, t: torch.Tensor, where: str) -> None:
    """Integer, NaN or infinite weights decode garbage without any error downstream (cost: see docs/design.md)."""
    if not t.is_floating_point():
        raise SwiftkError(f"{where}: tensor {name} has dtype {str(t.dtype).replace('torch.', '')}; weights must be "
                          f"floating point")
    if bool(torch.isfinite(t.sum(dtype=torch.float64))):
        return   # one reduction: NaN and infinities propagate through a sum
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise SwiftkError(f"{where}: tensor {name} holds {bad} NaN or infinite value(s); the file is damaged")


def _weight_buffers(want, by_name) -> dict:
    """HF name -> [rows, bytes per row] uint8 view for every matrix kept in its blocks, all in one buffer in 2 MiB
    pages (runtime/hugepages.py: a decode step streams them all), in ``want``'s order: a layer's q, k, v and its
    gate, up lie back to back, so the matrix the Model stacks from them is a view (weights.BlockWeight.cat) and a
    load never holds a second copy of them (peak memory ~ the file, not 1.6x)."""
    spans, total = {}, 0
    for hf in want:
        t = by_name[_hf_to_gguf_name(hf)]
        if _MATRIX.search(hf) and int(t.tensor_type) in TYPES.values():
            rows, rb = t.data.shape
            if not hf.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
                total = (total + 63) // 64 * 64   # a matrix that starts a stack, or stands alone, on a cache line
            spans[hf] = (total, rows, rb)
            total += rows * rb
    arena = hugepages.empty(total)
    return {hf: arena[o:o + rows * rb].view(rows, rb) for hf, (o, rows, rb) in spans.items()}


def _pack_in_place(w: BlockWeight) -> BlockWeight:
    """``w``'s blocks packed for the int8 kernel (ops/cpu_quant.repack) into the buffer they were read into: the
    extra memory is one tensor's, for a moment."""
    for raw, t in w.parts:
        raw.copy_(cpu_quant.repack(raw, t, w.K))
    return BlockWeight(w.parts, w.K, "int8")


def _unpermute_any(w, n_head: int):
    """_unpermute on a float tensor or, in place, on a block weight's rows (a row permutation: blocks move
    whole; in place keeps rows read into a shared buffer where they are)."""
    if isinstance(w, BlockWeight):
        for raw, _ in w.parts:
            raw.copy_(_unpermute(raw, n_head))
        return w
    return _unpermute(w, n_head)


# byte offsets of each block format's float16 fields (scales, mins): every other field is a small integer, so the
# weights are finite exactly when these are
_F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}


def _check_blocks(name: str, w: BlockWeight, where: str) -> None:
    """_check_weights for a block weight, from its float16 scale fields alone (a read of ~2% of its bytes)."""
    for raw, t in w.parts:
        qt = GGMLQuantizationType(t)
        ts = GGML_QUANT_SIZES[qt][1]
        blocks = raw.numpy().reshape(-1, ts)
        for off in _F16_FIELDS[qt.name]:
            if not np.isfinite(blocks[:, off:off + 2].copy().view(np.float16)).all():
                raise SwiftkError(f"{where}: tensor {name} has NaN or infinite values; the weights are corrupt")


def _check_tokenizer(tok: Tokenizer, cfg: ModelConfig, where: str) -> None:
    # Token ids past the embedding would index out of it at the first prompt that uses them.
    if tok.vocab_size > cfg.vocab_size:
        raise SwiftkError(f"{where}: the tokenizer has {tok.vocab_size} tokens but the embedding only "
                          f"{cfg.vocab_size} rows; tokenizer and weights are from different models")


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------
# matrices the block kernel can read in place (the norms and biases are small and stay float)
_MATRIX = re.compile(r"(_proj\.weight|embed_tokens\.weight|lm_head\.weight)$")


def _load_gguf(path: Path, dtype: torch.dtype, native: bool = False, pack: bool = False) -> Checkpoint:
    gf = read_gguf(path)
    meta = gf.metadata
    by_name = {t.name: t for t in gf.tensors}
    cfg = _gguf_config(meta, by_name, path)
    check_layer_count(cfg.n_layers, by_name, _BLK, f"metadata {cfg.arch}.block_count", f"GGUF {path.name}")
    want = expected_shapes(cfg)
    supported = _supported_qtypes()
    # Validate names, shapes and quant types before the (slow) dequantization.
    for hf, shape in want.items():
        g = _hf_to_gguf_name(hf)
        t = by_name.get(g)
        if t is None:
            raise SwiftkError(f"GGUF {path.name}: missing tensor {g} ({hf})")
        _check_shape(g, _numpy_shape(t), shape, hf)
        if t.tensor_type not in supported:
            raise SwiftkError(f"GGUF {path.name}: unsupported quant type {t.tensor_type.name} in tensor {g}")
    if native == "auto":   # a quantized file: its layer matrices (not just the embedding) are block formats
        native = all(int(t.tensor_type) in TYPES.values() for t in gf.tensors if t.name.endswith("ffn_down.weight"))
    shared = _weight_buffers(want, by_name) if native else {}
    tensors = {}
    with open(path, "rb") as f:
        for hf in want:
            g = _hf_to_gguf_name(hf)
            t = by_name[g]
            if native and _MATRIX.search(hf) and int(t.tensor_type) in TYPES.values():
                w = read_blocks(f, t, f"GGUF {path.name}", out=shared.get(hf))
                _check_blocks(g, w, f"GGUF {path.name}")
            else:
                w = _dequantize(t, dtype)
                _check_weights(g, w, f"GGUF {path.name}")
            if cfg.arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
                w = _unpermute_any(w, cfg.n_heads if ".q_proj." in hf else cfg.n_kv_heads)
            if pack and isinstance(w, BlockWeight):
                w = _pack_in_place(w)
            tensors[hf] = w
    try:
        tok = Tokenizer.from_gguf_metadata({k: v for k, v in meta.items() if k.startswith("tokenizer.")})
    except KeyError as e:
        raise SwiftkError(f"GGUF {path.name}: tokenizer metadata lacks {e}") from e
    except SwiftkError as e:
        raise SwiftkError(f"GGUF {path.name}: {e}") from None
    _check_tokenizer(tok, cfg, f"GGUF {path.name}")
    ident = {
        "name": cfg.name,
        "path": str(path.resolve()),
        "fingerprint": _fingerprint([path]),
        "arch": cfg.arch,
        "n_layers": cfg.n_layers,
    }
    return Checkpoint(cfg, tensors, tok, ident, native=any(isinstance(t, BlockWeight) for t in tensors.values()))


def _fingerprint(files) -> str:
    """Cheap content id: sizes plus the first and last MiB of each file (not a full hash)."""
    h = hashlib.sha256()
    for f in files:
        size = os.path.getsize(f)
        h.update(f"{Path(f).name}:{size};".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > (2 << 20):
                fh.seek(size - (1 << 20))
                h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Hugging Face directory
# ---------------------------------------------------------------------------------------------
def _safetensors_files(d: Path) -> list:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        wm = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) and v and Path(v).name == v
                                                         for v in wm.values()):
            raise SwiftkError(f"{index}: weight_map must map tensor names to shard file names in the same folder")
        files = sorted({d / f for f in wm.values()})
        for f in files:
            if not f.exists():
                raise SwiftkError(f"{index} names a missing shard {f.name}")
            regular_file(f, "safetensors shard")
        return files
    files = [regular_file(f, "safetensors file") for f in sorted(d.glob("*.safetensors"))]
    if not files:
        raise SwiftkError(f"{d} has no *.safetensors weights (pickled .bin checkpoints are not loaded)")
    return files


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _safetensors_keys(f: Path) -> list:
    """Tensor names in one safetensors file (reads only its header)."""
    from safetensors import safe_open   # lazy: only a Hugging Face directory needs safetensors

    try:
        with safe_open(str(f), framework="pt") as sf:
            return list(sf.keys())
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise SwiftkError(f"cannot read {f}: corrupt or truncated safetensors file ({e})") from e


def _load_hf_dir(d: Path, dtype: torch.dtype) -> Checkpoint:
    from safetensors import safe_open   # lazy: only a Hugging Face directory needs safetensors

    raw = read_json(d / "config.json", "config.json")
    name = raw.get("_name_or_path") or raw.get("_model_name_or_path")
    try:
        cfg = from_hf_config(raw, name=name if isinstance(name, str) and name else d.name)
    except KeyError as e:
        raise SwiftkError(f"{d / 'config.json'} lacks {e}") from e
    cfg.extra["format"] = "hf"
    files = _safetensors_files(d)
    names = [k for f in files for k in _safetensors_keys(f)]
    check_layer_count(cfg.n_layers, names, _HF_LAYER, "config.json num_hidden_layers", str(d))
    want = expected_shapes(cfg)
    tensors, lm_head = {}, None
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    if k in want:
                        t = sf.get_tensor(k)
                        _check_shape(k, t.shape, want[k], f.name)
                        _check_weights(k, t, f.name)
                        tensors[k] = t.to(dtype)
                    elif k == "lm_head.weight":
                        lm_head = k
        except SwiftkError:
            raise
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise SwiftkError(f"cannot read {f}: corrupt or truncated safetensors file ({e})") from e
    missing = [k for k in want if k not in tensors]
    if missing:
        raise SwiftkError(f"{d}: missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    del lm_head  # a tied model may still ship lm_head.weight; the runtime uses the embedding
    tok = Tokenizer.from_hf_dir(d)
    _check_tokenizer(tok, cfg, str(d))
    ident = {
        "name": cfg.name,
        "path": str(d.resolve()),
        "fingerprint": _fingerprint([d / "config.json", *files]),
        "arch": cfg.arch,
        "n_layers": cfg.n_layers,
    }
    return Checkpoint(cfg, tensors, tok, ident)
