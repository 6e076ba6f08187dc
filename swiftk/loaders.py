"""Checkpoint loading: a GGUF file or a Hugging Face directory -> config, HF-named tensors, tokenizer.

Every loader returns tensors under Hugging Face names and layout ([out, in] weights, Q/K rows in
HF's rotate-half order), on CPU, in the requested dtype, checked against the config's shapes.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .config import SUPPORTED_ARCHS, ModelConfig, from_hf_config, positive_float, positive_int
from .errors import SwiftkError
from .tokenizer import Tokenizer

# Dequantize this many elements at a time so peak memory stays near the output tensor's size.
_CHUNK_ELEMS = 1 << 24


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict  # HF name -> torch.Tensor (CPU, requested dtype)
    tokenizer: Tokenizer
    identity: dict  # name, path, fingerprint, arch, n_layers: tags results (e.g. saved skip sets)


def load_checkpoint(path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load a ``.gguf`` file or a Hugging Face model directory."""
    p = Path(path).expanduser()
    if not p.exists():
        raise SwiftkError(f"model path not found: {p}")
    if p.is_dir():
        if (p / "config.json").is_file():
            return _load_hf_dir(p, dtype)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype)
        raise SwiftkError(f"{p} is not a Hugging Face model directory (no config.json) and holds no single .gguf file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise SwiftkError(f"{p} is not a GGUF file (magic {magic!r}) and not a Hugging Face directory")
    return _load_gguf(p, dtype)


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


def _check_shape(name: str, got, want, source: str = "") -> None:
    if tuple(got) != tuple(want):
        src = f" ({source})" if source else ""
        raise SwiftkError(f"shape mismatch for tensor {name}{src}: expected {tuple(want)}, got {tuple(got)}")


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_to_hf_name(name: str) -> Optional[str]:
    """HF name for a GGUF tensor name, or None for tensors the runtime does not use."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _BLK.match(name)
    if m and m.group(2) in _GGUF_BLOCK:
        return f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}"
    return None


def _hf_to_gguf_name(hf: str) -> str:
    for g, h in _GGUF_GLOBAL.items():
        if h == hf:
            return g
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf)
    for g, h in _GGUF_BLOCK.items():
        if m and h == m.group(2):
            return f"blk.{m.group(1)}.{g}"
    return hf


def _supported_qtypes():
    from gguf import GGMLQuantizationType as Q

    return {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple  # ggml order: innermost dimension first
    n_bytes: int
    data: np.ndarray  # raw bytes (uint8), one row of blocks per output row


@dataclass
class GGUFFile:
    metadata: dict
    tensors: list


# The reader's own header entries, which are not file metadata.
_READER_PSEUDO_FIELDS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


@functools.lru_cache(maxsize=None)
def _reader_class():
    from gguf import GGUFReader, GGUFValueType

    class _PlainViewReader(GGUFReader):
        """GGUFReader over a plain ndarray view of its memmap.

        The reader slices its ``data`` once per metadata value; on an ``np.memmap`` each slice pays
        memmap's subclass bookkeeping, which makes a 150k-token vocabulary take seconds. A plain view
        of the same mapping reads the same bytes about 2.5x faster (and keeps the mapping alive).
        """

        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray)

        def _get_field_parts(self, orig_offs, raw_type):
            # The reader walks an array one element at a time, and past the end of the file a read returns
            # an empty view without moving on: an array header claiming 10**12 elements would loop until
            # memory runs out. So the claimed elements must fit in the bytes left (strings take >= 8 each).
            if raw_type == GGUFValueType.ARRAY:
                item_type = int(self._get(orig_offs, np.uint32)[0])
                count = int(self._get(orig_offs + 4, np.uint64)[0])
                np_type = self.gguf_scalar_to_np.get(item_type)
                item_size = np.dtype(np_type).itemsize if np_type else 8 if item_type == GGUFValueType.STRING else 12
                if count * item_size > len(self.data) - orig_offs - 12:
                    raise ValueError(f"array at byte {orig_offs} claims {count} elements, more than the file holds")
            return super()._get_field_parts(orig_offs, raw_type)

    return _PlainViewReader


def _text(part: np.ndarray) -> str:
    # Lenient like llama.cpp: a stray invalid byte in one token must not make the whole file unreadable.
    return part.tobytes().decode("utf-8", errors="replace")


def _field_value(field):
    """A reader field as a plain Python value (str, int, float, bool or a flat list of those)."""
    from gguf import GGUFValueType as T

    main = field.types[0] if field.types else None
    if main == T.STRING:
        return _text(field.parts[-1])
    if main == T.ARRAY:
        if len(field.types) < 2:  # an empty array records no element type
            return []
        if field.types[-1] == T.STRING:
            return [_text(field.parts[i]) for i in field.data]
        # One numpy view per element: join them in one go (token_type has ~150k entries).
        # Nested arrays come out flattened, as the reader itself flattens them.
        return np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
    return field.contents()


def read_gguf(path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor index with gguf.GGUFReader; tensor data stays memory-mapped."""
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    path = Path(path)
    size = path.stat().st_size
    # Magic and version are checked up front so those two get precise messages; the reader's own
    # errors for them are plain ValueErrors, indistinguishable from a corrupt header.
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != b"GGUF":
        raise SwiftkError(f"{path} is not a GGUF file (bad magic or too short)")
    version = int.from_bytes(head[4:8], "little")
    if version not in READER_SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise SwiftkError(f"{path}: unsupported GGUF version {version}{hint}")
    try:
        reader = _reader_class()(path)
    except Exception as e:  # a short or damaged header surfaces as Index/Value/Key errors from numpy slicing
        if isinstance(e, ValueError) and "GGMLQuantizationType" in str(e):
            raise SwiftkError(f"GGUF {path.name}: unsupported quant type ({e})") from e
        raise SwiftkError(f"GGUF {path} is truncated or corrupt: {type(e).__name__}: {e}") from e
    if reader.byte_order != "I":
        raise SwiftkError(f"GGUF {path.name} has non-native byte order, which swiftk does not support")
    meta = {name: _field_value(f) for name, f in reader.fields.items() if name not in _READER_PSEUDO_FIELDS}
    tensors = []
    for rt in reader.tensors:
        dims = tuple(int(d) for d in rt.shape)
        n_bytes = int(rt.n_bytes)
        end = int(rt.data_offset) + n_bytes
        if end > size:
            raise SwiftkError(f"GGUF {path} is truncated: tensor {rt.name} needs bytes up to {end}, file has {size}")
        row = dims[0] if dims else 1
        rows = int(rt.n_elements) // row if row else 0
        # The reader types F32/F16/int tensors; the dequantizer wants raw bytes, one row of blocks per row.
        raw = np.asarray(rt.data).reshape(-1).view(np.uint8)
        tensors.append(GGUFTensor(rt.name, rt.tensor_type, dims, n_bytes, raw.reshape(rows, n_bytes // max(rows, 1))))
    return GGUFFile(meta, tensors)


def _gguf_config(meta: dict, tensors_by_name: dict, path: Path) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise SwiftkError(f"unsupported architecture {arch!r} in {path.name}; swiftk supports {', '.join(SUPPORTED_ARCHS)}")

    def get(key, default=None, required=True):
        v = meta.get(f"{arch}.{key}", default)
        if v is None and required:
            raise SwiftkError(f"GGUF {path.name} lacks metadata {arch}.{key}")
        return v

    # Checked under their metadata names before any arithmetic (head_count 0 would divide by zero).
    def count(key, default=None):
        return positive_int(get(key, default), f"GGUF {path.name}: metadata {arch}.{key}")

    def real(key, default):
        return positive_float(get(key, default), f"GGUF {path.name}: metadata {arch}.{key}")

    emb = tensors_by_name.get("token_embd.weight")
    if emb is None:
        raise SwiftkError(f"GGUF {path.name}: missing tensor token_embd.weight")
    if len(emb.shape) != 2:
        raise SwiftkError(f"GGUF {path.name}: token_embd.weight must be 2-D, got shape {_numpy_shape(emb)}")
    hidden = count("embedding_length")
    n_heads = count("attention.head_count")
    n_kv = count("attention.head_count_kv", n_heads)
    head_dim = count("attention.key_length", hidden // n_heads)

    stype = meta.get(f"{arch}.rope.scaling.type")
    sfactor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if stype not in (None, "none") and sfactor != 1.0:
        # llama3-style scaling arrives as the rope_freqs tensor; other kinds change the math.
        raise SwiftkError(f"unsupported RoPE scaling type {stype!r} (factor {sfactor}) in {path.name}")
    freq_factors = None
    rf = tensors_by_name.get("rope_freqs.weight")
    if rf is not None:
        # Checked before dequantizing: this tensor is read before the general shape checks.
        _check_shape("rope_freqs.weight", _numpy_shape(rf), (head_dim // 2,))
        if rf.tensor_type not in _supported_qtypes():
            raise SwiftkError(f"GGUF {path.name}: unsupported quant type {rf.tensor_type.name} "
                              f"in tensor rope_freqs.weight")
        freq_factors = _dequantize(rf, torch.float32).flatten().tolist()
    return ModelConfig(
        arch=arch,
        vocab_size=int(emb.shape[1]),  # ggml dims are [ne0=hidden, ne1=vocab]
        hidden_size=hidden,
        intermediate_size=count("feed_forward_length"),
        n_layers=count("block_count"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rms_eps=real("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=real("rope.freq_base", 10000.0),
        max_position=count("context_length", 2048),
        tie_embeddings="output.weight" not in tensors_by_name,
        qkv_bias="blk.0.attn_q.bias" in tensors_by_name,
        rope_scaling=None,  # llama3 scaling arrives as rope_freq_factors
        rope_freq_factors=freq_factors,
        name=str(meta.get("general.name") or path.stem),
        extra={"gguf_file_type": meta.get("general.file_type"), "format": "gguf"},
    ).validate()


def _numpy_shape(t) -> tuple:
    # ggml lists dims innermost first; numpy/torch order is the reverse.
    return tuple(int(d) for d in reversed(t.shape))


def _dequantize(t: GGUFTensor, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor -> torch tensor in numpy order, dequantized a chunk of rows at a time.

    Calls gguf's vectorized per-type ``dequantize_rows`` on whole chunks: ``gguf.quants.dequantize``
    loops over groups of 16 rows, which is several times slower on big tensors. (Torch ports of the
    block formats were tried and were slower on CPU than gguf's numpy.)
    """
    import gguf.quants as gq
    from gguf import GGMLQuantizationType as Q

    shape = _numpy_shape(t)
    rows = t.data.shape[0]
    cols = int(t.shape[0]) if t.shape else 1
    out = torch.empty((rows, cols), dtype=dtype)
    step = max(1, _CHUNK_ELEMS // max(1, cols))
    for i in range(0, rows, step):
        chunk = t.data[i : i + step]
        if t.tensor_type == Q.F32:
            vals = chunk.view(np.float32)
        elif t.tensor_type == Q.F16:
            vals = chunk.view(np.float16)
        else:
            vals = getattr(gq, t.tensor_type.name).dequantize_rows(chunk)
        # copy_ converts to the target dtype; the source may be a read-only view of the mapped file
        out[i : i + step].copy_(torch.from_numpy(np.array(vals, copy=True)).reshape(-1, cols))
    return out.reshape(shape)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF rotate-half halves)."""
    d = w.shape[0]
    hd = d // n_head
    rest = w.shape[1:]
    return w.reshape(n_head, hd // 2, 2, *rest).transpose(1, 2).reshape(d, *rest).contiguous()


def _load_gguf(path: Path, dtype: torch.dtype) -> Checkpoint:
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
    tensors = {}
    for hf in want:
        g = _hf_to_gguf_name(hf)
        w = _dequantize(by_name[g], dtype)
        if cfg.arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            w = _unpermute(w, cfg.n_heads if ".q_proj." in hf else cfg.n_kv_heads)
        tensors[hf] = w
    try:
        tok = Tokenizer.from_gguf_metadata({k: v for k, v in meta.items() if k.startswith("tokenizer.")})
    except KeyError as e:
        raise SwiftkError(f"GGUF {path.name}: tokenizer metadata lacks {e}") from e
    ident = {
        "name": cfg.name,
        "path": str(path.resolve()),
        "fingerprint": _fingerprint([path]),
        "arch": cfg.arch,
        "n_layers": cfg.n_layers,
    }
    return Checkpoint(cfg, tensors, tok, ident)


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
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise SwiftkError(f"{index} is not a valid safetensors index: {e}") from e
        files = sorted({d / f for f in wm.values()})
        for f in files:
            if not f.is_file():
                raise SwiftkError(f"{index} names a missing shard {f.name}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise SwiftkError(f"{d} has no *.safetensors weights (pickled .bin checkpoints are not loaded)")
    return files


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _safetensors_keys(f: Path) -> list:
    """Tensor names in one safetensors file (reads only its header)."""
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt") as sf:
            return list(sf.keys())
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise SwiftkError(f"cannot read {f}: corrupt or truncated safetensors file ({e})") from e


def _load_hf_dir(d: Path, dtype: torch.dtype) -> Checkpoint:
    from safetensors import safe_open

    try:
        raw = json.loads((d / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SwiftkError(f"{d / 'config.json'} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise SwiftkError(f"{d / 'config.json'} must hold a JSON object, got {type(raw).__name__}")
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
    ident = {
        "name": cfg.name,
        "path": str(d.resolve()),
        "fingerprint": _fingerprint([d / "config.json", *files]),
        "arch": cfg.arch,
        "n_layers": cfg.n_layers,
    }
    return Checkpoint(cfg, tensors, tok, ident)
