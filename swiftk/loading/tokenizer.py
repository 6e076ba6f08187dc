"""Tokenizer built with the `tokenizers` library from GGUF metadata or a Hugging Face directory.

GGUF files carry no tokenizer.json: only the vocabulary, merges, token types and the name of
llama.cpp's pre-tokenizer (``tokenizer.ggml.pre``). We rebuild the byte-level BPE pipeline from
those, choosing the split regex llama.cpp uses for that pre-tokenizer name.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Iterable, Optional

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from ..errors import SwiftkError, warn
from ..files import MAX_JSON_BYTES, read_json, read_text
from .chat import ChatTemplate

# Split regexes, per llama.cpp's pre-tokenizer types (facts from llama.cpp's llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizer names that llama.cpp handles as "single digits, then the GPT-2 regex".
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
_LLAMA3_NAMES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"}
_QWEN2_NAMES = {"qwen2", "deepseek-r1-qwen", "megrez"}
_GPT2_NAMES = {"gpt2", "default", "gpt-2", "jais", "olmo", "phi-2", "stablelm2", "mpt", "poro-chat"}

# Token types in GGUF's tokenizer.ggml.token_type.
_CONTROL, _USER_DEFINED = 3, 4

# Tokens that end a turn in common chat templates; generation stops on any of them if present.
_END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>",
)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}


def _pre_tokenizer_for(pre: Optional[str]):
    pre = (pre or "default").lower()
    byte_level_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre in _LLAMA3_NAMES:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"), byte_level_only])
    if pre in _QWEN2_NAMES:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated"), byte_level_only])
    if pre not in _GPT2_NAMES:
        warn(f"swiftk: unknown GGUF pre-tokenizer {pre!r}; using the GPT-2 split, token ids may differ from llama.cpp")
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _token_content(tok, field: str = "special token") -> Optional[str]:
    """tokenizer_config.json stores special tokens either as strings or as AddedToken dicts."""
    c = tok.get("content") if isinstance(tok, dict) else tok
    if c is not None and not isinstance(c, str):
        raise SwiftkError(f"{field} must be a string or {{\"content\": string}}, got {tok!r}")
    return c


def _token_ids(value, field: str, n: int) -> list:
    """A token id or list of ids from metadata, each an int in [0, n); None gives []."""
    vals = [] if value is None else value if isinstance(value, list) else [value]
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
            raise SwiftkError(f"{field} must be token ids in [0, {n}), got {value!r}")
    return vals


class Tokenizer:
    """Text <-> token ids, special tokens and chat template of one model."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_id: Optional[int],
        eos_id: Optional[int],
        eos_ids: Iterable[int] = (),
        add_bos: bool,
        chat_template: Optional[str],
        vocab_size: int,
        special_ids: Iterable[int],
    ):
        self._tok = backend
        self.bos_id = bos_id
        self.add_bos = bool(add_bos and bos_id is not None)
        self.chat_template = chat_template
        self.vocab_size = int(vocab_size)
        self.special_ids = set(int(i) for i in special_ids)
        self.eos_id = eos_id
        eos = set(int(i) for i in eos_ids)
        if eos_id is not None:
            eos.add(int(eos_id))
        # Any end-of-turn token the vocabulary knows as special also stops generation.
        for t in _END_OF_TURN_TOKENS:
            i = backend.token_to_id(t)
            if i is not None and i in self.special_ids:
                eos.add(i)
        self.eos_ids = eos
        self._template = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """Build from a dict of ``tokenizer.*`` GGUF metadata values (plain Python values)."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise SwiftkError(
                f"unsupported GGUF tokenizer model {model!r}; swiftk supports byte-level BPE ('gpt2')"
            )
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise SwiftkError("GGUF tokenizer.ggml.tokens must be a non-empty list of strings")
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        types = [1] * n if types is None else types
        if not isinstance(types, list) or len(types) != n or not all(isinstance(t, int) for t in types):
            raise SwiftkError(f"GGUF tokenizer.ggml.token_type must be {n} integers, one per token "
                              f"(got {len(types) if isinstance(types, list) else type(types).__name__})")
        merges = meta.get("tokenizer.ggml.merges")
        if merges is None:
            raise SwiftkError("GGUF tokenizer has no tokenizer.ggml.merges")
        if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
            raise SwiftkError("GGUF tokenizer.ggml.merges must be a list of strings 'left right'")
        ids = {k: _token_ids(meta.get(f"tokenizer.ggml.{k}_token_id"), f"GGUF tokenizer.ggml.{k}_token_id", n)
               for k in ("bos", "eos", "eot", "eom")}
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        template = meta.get("tokenizer.chat_template")
        if not isinstance(add_bos, (bool, type(None))) or not isinstance(template, (str, type(None))):
            raise SwiftkError("GGUF tokenizer.ggml.add_bos_token must be a bool and tokenizer.chat_template a "
                              "string")
        b2u = _byte_to_unicode()
        alphabet = set(b2u.values())
        vocab = {}
        for i, (t, ty) in enumerate(zip(tokens, types)):
            # Normal tokens must be spelled in the byte alphabet; some files store them as raw text.
            if ty not in (_CONTROL, _USER_DEFINED) and not set(t) <= alphabet:
                t = "".join(b2u[b] for b in t.encode("utf-8"))
            vocab.setdefault(t, i)
        pre = meta.get("tokenizer.ggml.pre")
        try:
            bpe = models.BPE(
                vocab=vocab,
                merges=[tuple(m.split(" ", 1)) for m in merges],
                # llama.cpp's llama3 pre-tokenizer looks a whole word up in the vocabulary before merging.
                ignore_merges=(str(pre or "")).lower() in _LLAMA3_NAMES,
            )
        except Exception as e:  # tokenizers raises its own Exception type
            raise SwiftkError(f"GGUF tokenizer metadata does not make a BPE tokenizer: {e}") from None
        backend = _HFTokenizer(bpe)
        backend.pre_tokenizer = _pre_tokenizer_for(pre)
        backend.decoder = decoders.ByteLevel()
        special, user = [], []
        for t, ty in zip(tokens, types):
            if ty == _CONTROL:
                special.append(AddedToken(t, special=True, normalized=False))
            elif ty == _USER_DEFINED:
                user.append(AddedToken(t, special=False, normalized=False))
        if special:
            backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)
        special_ids = {i for i, ty in enumerate(types) if ty == _CONTROL}
        return cls(
            backend,
            bos_id=ids["bos"][0] if ids["bos"] else None,
            eos_id=ids["eos"][0] if ids["eos"] else None,
            eos_ids=ids["eot"] + ids["eom"],
            add_bos=bool(add_bos),
            chat_template=template,
            vocab_size=len(tokens),
            special_ids=special_ids,
        )

    @classmethod
    def from_hf_dir(cls, path) -> "Tokenizer":
        """Build from a Hugging Face model directory (tokenizer.json + tokenizer_config.json)."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise SwiftkError(f"no tokenizer.json in {path}")
        try:
            backend = _HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises its own Exception type
            raise SwiftkError(f"cannot read {tj}: {e}") from e
        tc = _read_json(path / "tokenizer_config.json")
        cfg = _read_json(path / "config.json")
        gen = _read_json(path / "generation_config.json")

        n = backend.get_vocab_size(with_added_tokens=True)

        def tid(key):
            c = _token_content(tc.get(key), f"{key} in tokenizer_config.json")
            return backend.token_to_id(c) if c else None

        bos = tid("bos_token")
        if bos is None:
            bos = (_token_ids(cfg.get("bos_token_id"), "bos_token_id in config.json", n)
                   or _token_ids(gen.get("bos_token_id"), "bos_token_id in generation_config.json", n) or [None])[0]
        eos_id = tid("eos_token")
        eos = set() if eos_id is None else {eos_id}
        eos.update(_token_ids(cfg.get("eos_token_id"), "eos_token_id in config.json", n))
        eos.update(_token_ids(gen.get("eos_token_id"), "eos_token_id in generation_config.json", n))
        add_bos = tc.get("add_bos_token")
        if add_bos is None and bos is not None:
            # No flag: the tokenizer.json post-processor decides (LLaMA-3 style templates add BOS).
            enc = backend.encode("a", add_special_tokens=True).ids
            add_bos = bool(enc) and enc[0] == bos
        template = tc.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t.get("template") for t in template if isinstance(t, dict) and
                             t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = read_text(path / "chat_template.jinja", "chat template", MAX_JSON_BYTES)
        if not isinstance(template, (str, type(None))) or not isinstance(add_bos, (bool, type(None))):
            raise SwiftkError(f"{path / 'tokenizer_config.json'}: chat_template must be a string (or a list of "
                              f"named ones) and add_bos_token a bool")
        special_ids = {i for i, _ in _added_special(backend)}
        return cls(
            backend,
            bos_id=bos,
            eos_id=eos_id if eos_id is not None else (min(eos) if eos else None),
            eos_ids=eos,
            add_bos=bool(add_bos),
            chat_template=template,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            special_ids=special_ids,
        )

    def hf_files(self) -> dict:
        """This tokenizer as a Hugging Face directory's files: {"tokenizer.json": text, "tokenizer_config.json":
        dict}; :meth:`from_hf_dir` on them gives the same tokenization, specials and template (exports for other
        engines: swiftk.integrations.hf_export)."""
        def token(i):
            return None if i is None else self._tok.id_to_token(int(i))

        cfg = {"bos_token": token(self.bos_id), "eos_token": token(self.eos_id), "add_bos_token": self.add_bos,
               "add_eos_token": False, "clean_up_tokenization_spaces": False,
               "tokenizer_class": "PreTrainedTokenizerFast"}
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        return {"tokenizer.json": self._tok.to_str(), "tokenizer_config.json": cfg}

    def fingerprint(self) -> str:
        """A content id of the tokenization (vocabulary, merges, pre-tokenizer, added tokens, eos): two model files
        with the same tokenizer share what is cached per tokenizer (the corpus tables)."""
        if getattr(self, "_fingerprint", None) is None:
            h = hashlib.sha256(self._tok.to_str().encode("utf-8"))
            h.update(repr((self.eos_id, self.bos_id, self.add_bos)).encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def ids_fingerprint(self) -> str:
        """A content id of what the token ids mean (vocabulary, merges, added tokens) without which token ends a
        sequence: a draft model must propose the target's ids, whatever each file calls end-of-sequence."""
        return hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()[:16]

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text a token covers (bounded by the longest vocabulary entry in UTF-8)."""
        return max([len(t.encode("utf-8", "surrogatepass")) for t in self._tok.get_vocab()] or [1])

    # ---- use ----------------------------------------------------------------------------
    def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
        _check_text(text, "text to encode")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def encode_batch(self, texts: list) -> list:
        """Token ids of each text (no BOS), the backend encoding them on all cores."""
        for t in texts:
            _check_text(t, "text to encode")
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True):
        """An incremental decoder: a function of the next token id -> the text it completes ("" while a character
        is incomplete); the pieces join to ``decode`` of the ids (the backend's DecodeStream). None where the
        backend has none."""
        if not hasattr(decoders, "DecodeStream"):
            return None
        ds, tok = decoders.DecodeStream(skip_special_tokens=skip_special_tokens), self._tok
        return lambda i: ds.step(tok, int(i)) or ""

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self._tok.id_to_token(int(i))

    @functools.cached_property
    def byte_level(self) -> bool:
        """Whether the pieces are byte-level BPE (GPT-2's byte alphabet): then token_bytes is exact for every id."""
        return type(self._tok.decoder).__name__ == "ByteLevel"

    @functools.cached_property
    def _added(self) -> dict:
        return {int(i): a.content for i, a in self._tok.get_added_tokens_decoder().items()}

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for (a byte-level piece may be part of a character decode() shows as �; an
        added token stands for its text)."""
        if int(i) in self._added:
            return self._added[int(i)].encode("utf-8", "surrogatepass")
        piece = self._tok.id_to_token(int(i)) or ""
        if i not in self.special_ids and piece and all(ch in _UNICODE_TO_BYTE for ch in piece):
            return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
        return self._tok.decode([int(i)], skip_special_tokens=False).encode("utf-8", "surrogatepass")

    @property
    def bos_token(self) -> str:
        return self._tok.id_to_token(self.bos_id) if self.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._tok.id_to_token(self.eos_id) if self.eos_id is not None else ""

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the model's chat template (loading/chat.py: sandboxed jinja2, like transformers does)."""
        if not self.chat_template:
            raise SwiftkError("this model has no chat template; pass a plain prompt instead")
        if self._template is None or self._template.text != self.chat_template:   # chat_template may be replaced
            self._template = ChatTemplate(self.chat_template)
        return self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)


def _check_text(text, what: str) -> None:
    """SwiftkError unless ``text`` is a str that UTF-8 can encode (the tokenizers library raises TypeError)."""
    if not isinstance(text, str):
        raise SwiftkError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # only lone surrogates such as "\ud800" fail here
        raise SwiftkError(f"{what} is not valid Unicode: lone surrogate {text[e.start]!r} at index {e.start}") from e


def _added_special(backend: _HFTokenizer):
    """(id, AddedToken) pairs of the tokenizer's special added tokens."""
    return [(i, a) for i, a in backend.get_added_tokens_decoder().items() if a.special]


def _read_json(p: Path) -> dict:
    return read_json(p, p.name) if p.exists() else {}
