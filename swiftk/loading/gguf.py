"""GGUF parsing: the file's metadata and tensors (via ``gguf.GGUFReader``), llama.cpp tensor names to Hugging Face
names, metadata -> ModelConfig, dequantization and llama.cpp's Q/K row permutation. loaders.py assembles the
checkpoint from these.
"""
from __future__ import annotations

import contextlib
import re
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import gguf.quants as gq
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from ..runtime.config import SUPPORTED_ARCHS, ModelConfig, positive_float, positive_int
from ..errors import SwiftkError
from ..runtime.weights import BlockWeight

# Dequantize this many elements at a time so peak memory stays near the output tensor's size.
_CHUNK_ELEMS = 1 << 24


def _check_shape(name: str, got, want, source: str = "") -> None:
    if tuple(got) != tuple(want):
        src = f" ({source})" if source else ""
        raise SwiftkError(f"shape mismatch for tensor {name}{src}: expected {tuple(want)}, got {tuple(got)}")


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
    Q = GGMLQuantizationType
    return {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple  # ggml order: innermost dimension first
    n_bytes: int
    data: np.ndarray  # raw bytes (uint8), one row of blocks per output row
    offset: int = 0   # of the data in the file


@dataclass
class GGUFFile:
    metadata: dict
    tensors: list


# The reader's own header entries, which are not file metadata.
_READER_PSEUDO_FIELDS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


@contextlib.contextmanager
def _interrupt_after():
    """Ctrl-C during the block raises KeyboardInterrupt when it ends. NumPy's comparisons, which the reader runs per
    metadata value, clear an exception pending inside them, so a SIGINT landing there was lost."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield   # not ours to change: another thread, or the program's own handler
        return
    hit = []
    signal.signal(signal.SIGINT, lambda *_: hit.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hit:
        raise KeyboardInterrupt


def _open_reader(path: Path, size: int) -> "_PlainViewReader":
    try:
        return _PlainViewReader(path)
    except Exception as e:  # a short or damaged header surfaces as Index/Value/Key errors from numpy slicing
        if isinstance(e, ValueError) and "GGMLQuantizationType" in str(e):
            raise SwiftkError(f"GGUF {path.name}: unsupported quant type ({e})") from e
        # the reader's own messages are about numpy views, not the file: say what it means for the user
        what = str(e) if isinstance(e, _Impossible) else ("its header or tensor index ends early or holds "
                                                          "impossible sizes")
        raise SwiftkError(f"GGUF {path} is truncated or corrupt: {what} ({size} bytes on disk); get a fresh "
                          f"copy") from e


class _PlainViewReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memmap.

    The reader slices its ``data`` once per metadata value; on an ``np.memmap`` each slice pays
    memmap's subclass bookkeeping, which makes a 150k-token vocabulary take seconds. A plain view
    of the same mapping reads the same bytes faster (and keeps the mapping alive).
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
                raise _Impossible(f"array at byte {orig_offs} claims {count} elements, more than the file "
                                  f"holds")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_tensors(self, start_offs, fields):
        # A tensor whose data runs past the end of the file (a cut download) would surface as a numpy
        # reshape error; say which tensor, from the index alone, before the reader slices anything.
        for field in fields:
            _, name, _, dims, raw_dtype, offset = field.parts
            try:
                bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
            except (ValueError, KeyError):
                continue   # the reader's own error names the type
            end = int(start_offs + offset[0]) + int(np.prod(dims)) * ts // bs
            if end > len(self.data):
                raise _Impossible(f"tensor {bytes(name).decode('utf-8', 'replace')} needs bytes up to {end}, "
                                  f"the file ends at {len(self.data)} (truncated)")
        return super()._build_tensors(start_offs, fields)


def _text(part: np.ndarray) -> str:
    # Lenient like llama.cpp: a stray invalid byte in one token must not make the whole file unreadable.
    return part.tobytes().decode("utf-8", errors="replace")


def _field_value(field):
    """A reader field as a plain Python value (str, int, float, bool or a flat list of those)."""
    T = GGUFValueType
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


class _Impossible(ValueError):
    """A size the file cannot hold, found by swiftk's own reader checks (its message is for the user)."""


def read_gguf(path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor index with gguf.GGUFReader; tensor data stays memory-mapped."""
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
    with _interrupt_after():
        reader = _open_reader(path, size)
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
        tensors.append(GGUFTensor(rt.name, rt.tensor_type, dims, n_bytes, raw.reshape(rows, n_bytes // max(rows, 1)),
                                  int(rt.data_offset)))
    align = meta.get("general.alignment") or 32
    _check_layout(reader.tensors, positive_int(align, f"GGUF {path.name}: metadata general.alignment"), size, path)
    return GGUFFile(meta, tensors)


def _check_layout(tensors, align: int, size: int, path: Path) -> None:
    """Tensor data lies back to back, each start aligned. An overlap, or a gap of a whole alignment or more, means
    a damaged offset, type or shape in the index: the bytes would be read as another tensor or format."""
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in tensors)
    for (_, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise SwiftkError(f"GGUF {path.name}: tensors {n0} and {n1} overlap ({e0 - s1} bytes); the tensor index "
                              f"is damaged")
        if s1 - e0 >= align:
            raise SwiftkError(f"GGUF {path.name}: {s1 - e0} unused bytes after tensor {n0}: its type or shape does "
                              f"not match its data; the tensor index is damaged")
    if spans and size - spans[-1][1] >= align:
        raise SwiftkError(f"GGUF {path.name}: {size - spans[-1][1]} unused bytes after the last tensor "
                          f"{spans[-1][2]}: its type or shape does not match its data")


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

    stype = get("rope.scaling.type", required=False)
    if not isinstance(stype, (str, type(None))):
        raise SwiftkError(f"GGUF {path.name}: metadata {arch}.rope.scaling.type must be a string, got {stype!r}")
    sfactor = real("rope.scaling.factor", 1.0) if get("rope.scaling.factor", required=False) != 0 else 1.0
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
    Q = GGMLQuantizationType
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


def read_blocks(f, t: GGUFTensor, where: str, out=None):
    """A block-format tensor as a BlockWeight [rows, K], its bytes read from the open file ``f`` into memory the
    process owns (pages read through the reader's map would stay resident beside them: twice the file); into
    ``out`` (a [rows, bytes per row] uint8 view) when given."""
    rows, rb = t.data.shape
    K = int(t.shape[0]) if t.shape else 1
    bs, ts = GGML_QUANT_SIZES[t.tensor_type]
    if K % bs or rb != K // bs * ts or rows * rb != t.n_bytes:
        raise SwiftkError(f"{where}: tensor {t.name} ({t.tensor_type.name}, {K} columns) should hold {K // bs * ts} "
                          f"bytes per row, its data has {rb}; the file is damaged")
    buf = torch.empty((rows, rb), dtype=torch.uint8) if out is None else out
    if tuple(buf.shape) != (rows, rb) or buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise SwiftkError(f"{where}: tensor {t.name}: no room for {rows} rows of {rb} bytes in the given buffer")
    f.seek(t.offset)
    if f.readinto(memoryview(buf.numpy()).cast("B")) != rows * rb:
        raise SwiftkError(f"{where}: tensor {t.name} is truncated (the file ends inside its data)")
    return BlockWeight(((buf, int(t.tensor_type)),), K)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF rotate-half halves)."""
    d = w.shape[0]
    hd = d // n_head
    rest = w.shape[1:]
    return w.reshape(n_head, hd // 2, 2, *rest).transpose(1, 2).reshape(d, *rest).contiguous()
