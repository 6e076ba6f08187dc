"""The drafter's training text: corpora a machine without internet has, tokenized once and cached.

Sources (``--data``, repeatable; the documents of all of them are interleaved, one from each in turn):
  "stdlib"         the Python standard library's modules (test suites excluded)
  "site-packages"  the Python sources of the installed packages (tests excluded): code as people write it
  "docs"           English prose: text, Markdown, reST and HTML under /usr/share/doc, and the installed packages'
                   descriptions (their METADATA files)
  FILE.jsonl       prompts ``{"text": str, "chat": bool}`` per line: the document is the prompt and the target's
                   own greedy answer (self-distillation; ``answer_tokens`` each)
  FILE             its text, in pieces of ~DOC_CHARS characters cut at line ends (each piece a document)
Each document contributes its first ``DOC_TOKENS`` tokens (breadth over depth). One document in
``HELD_OUT_EVERY`` (by a hash of its name, so the split does not move when the budget does) goes to the held-out
set that training never sees. The token ids are cached under ``$SWIFTK_HOME/data`` (safetensors), keyed by the
recipe and the tokenizer.
"""
from __future__ import annotations

import hashlib
import json
import os
import site
import zlib
from html.parser import HTMLParser
from itertools import cycle
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..errors import SwiftkError
from ..files import read_text
from ..home import swiftk_home
from ..proposers.stdlib import stdlib_files
from ..target import Target

DOC_TOKENS = 2048
DOC_CHARS = 12_000        # read this much of a file: ~3k tokens of code, more than DOC_TOKENS keeps
HELD_OUT_EVERY = 20
RECIPE = 1                # bump when what a source yields changes: cached corpora are keyed on it
# (prompt, chat) -> the prompt's token ids followed by the target's answer (self-distillation)
Answer = Callable[[str, bool], list]
PROSE = (".txt", ".md", ".rst", ".html", ".htm")
_SKIP_DIRS = {"test", "tests", "testing", "__pycache__", "idlelib", "turtledemo", "ensurepip", "lib2to3"}


def _read(p: Path) -> str:
    try:
        with open(p, encoding="utf-8") as f:
            return f.read(DOC_CHARS)
    except (OSError, UnicodeDecodeError):
        return ""


def _site_roots() -> list:
    return sorted({Path(p) for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()})


def _python_files(root: Path):
    for p in sorted(root.rglob("*.py")):
        if not set(p.relative_to(root).parts[:-1]) & _SKIP_DIRS:
            yield p


class _Text(HTMLParser):
    """The visible text of an HTML page (scripts and styles dropped)."""

    def __init__(self):
        super().__init__()
        self.parts, self._hide = [], 0

    def handle_starttag(self, tag, attrs):
        self._hide += tag in ("script", "style")

    def handle_endtag(self, tag):
        self._hide -= tag in ("script", "style") and self._hide > 0

    def handle_data(self, data):
        if not self._hide and data.strip():
            self.parts.append(data.strip())


def _prose(p: Path) -> str:
    text = _read(p)
    if p.suffix in (".html", ".htm"):
        t = _Text()
        t.feed(text)
        text = "\n".join(t.parts)
    return text


def documents(source: str, answer: Optional[Answer] = None):
    """(name, text or token ids) of one source, in a fixed order; a JSONL file's prompts are answered by ``answer``."""
    if source == "stdlib":
        yield from ((str(p), _read(p)) for p in stdlib_files())
    elif source == "site-packages":
        for root in _site_roots():
            yield from ((str(p), _read(p)) for p in _python_files(root))
    elif source == "docs":
        files = sorted(p for p in Path("/usr/share/doc").rglob("*") if p.suffix in PROSE or p.name == "README")
        files += [p for root in _site_roots() for p in sorted(root.glob("*.dist-info/METADATA"))]
        yield from ((str(p), _prose(p)) for p in files if p.is_file())
    else:
        path = Path(source)
        if not path.is_file():
            raise SwiftkError(f"training source {source!r}: no such file (use stdlib, site-packages, docs, a .jsonl "
                              "of prompts or a text file)")
        text = read_text(path, "training source")
        if path.suffix != ".jsonl":
            # named by the file's name, not its folder: the held-out split does not move with the checkout
            yield from ((f"{path.name}:{i}", piece) for i, piece in enumerate(_pieces(text)))
            return
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                prompt, chat = str(r["text"]), bool(r.get("chat", False))
            except (ValueError, KeyError, TypeError) as e:
                raise SwiftkError(f"{path}:{i + 1}: expected {{\"text\": str, \"chat\": bool}} ({e})") from None
            if answer is None:
                raise SwiftkError(f"{path}: a JSONL file of prompts needs the target to answer them")
            yield f"{path.name}:{i + 1}", answer(prompt, chat)


def _pieces(text: str):
    """A long text in pieces of about DOC_CHARS characters, each ending at a line end where one is near."""
    i = 0
    while i < len(text):
        j = i + DOC_CHARS
        cut = text.rfind("\n", i + DOC_CHARS // 2, j) if j < len(text) else -1
        j = cut + 1 if cut > 0 else j
        yield text[i:j]
        i = j


def _file_stamp(source: str):
    """What identifies a user file's contents in the cache key: their sha256 (an edit keeping size and mtime too)."""
    h = hashlib.sha256()
    if not Path(source).is_file():   # not a regular file (a FIFO would block here): documents() refuses it
        return None
    try:
        with open(source, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None   # documents() says what is wrong with it
    return h.hexdigest()


def _interleaved(sources: list, answer: Optional[Answer]):
    """One document from each source in turn, until all are spent."""
    its = [documents(s, answer) for s in sources]
    live = list(range(len(its)))
    for i in cycle(range(len(its))):
        if not live:
            return
        if i not in live:
            continue
        doc = next(its[i], None)
        if doc is None:
            live.remove(i)
            continue
        yield doc


def corpus(target: Target, sources: list, max_tokens: int, answer: Optional[Answer] = None, answer_tokens: int = 128,
           progress: bool = True) -> dict:
    """{"train": uint32 ids, "held_out": uint32 ids, "spec": ...}: documents joined by EOS, at most ``max_tokens``
    in all; built once, then read from the cache. ``answer``: how a JSONL prompt is answered (the target's own
    greedy answer of ``answer_tokens`` tokens: self-distillation; the CLI gives it the engine's ``generate``)."""
    from safetensors import SafetensorError   # lazy: only where a corpus is built or read
    from safetensors.numpy import load_file, save_file   # lazy: the same

    tok = target.tokenizer
    spec = {"recipe": RECIPE, "sources": [str(s) for s in sources], "max_tokens": int(max_tokens),
            "files": [_file_stamp(s) for s in sources if s not in ("stdlib", "site-packages", "docs")],
            "answer_tokens": answer_tokens, "model": target.identity.get("fingerprint"),
            "tokenizer": tok.encode("def f(x):\n    return 'The quick brown fox.'", add_bos=False)}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    path = swiftk_home() / "data" / f"{target.name}-{key}.safetensors"
    if path.is_file():
        try:
            got = load_file(str(path))
            return {"train": got["train"], "held_out": got["held_out"], "spec": spec, "path": str(path)}
        except (OSError, KeyError, ValueError, SafetensorError):
            pass   # unreadable: built again below
    eos = min(tok.eos_ids) if tok.eos_ids else 0
    parts = {"train": [], "held_out": []}
    total = 0
    bar = None
    if progress:
        from tqdm import tqdm   # lazy: only for a progress bar

        bar = tqdm(total=max_tokens, desc="corpus", unit="tok", unit_scale=True, leave=False)
    for name, doc in _interleaved(sources, answer):
        ids = doc if isinstance(doc, list) else (tok.encode(doc, add_bos=False) if doc.strip() else [])
        ids = ids[: min(DOC_TOKENS, max_tokens - total - 1)]
        if len(ids) < 16:
            continue
        split = "held_out" if zlib.crc32(name.encode()) % HELD_OUT_EVERY == 0 else "train"
        parts[split].append(np.asarray(ids + [eos], dtype=np.uint32))
        total += len(ids) + 1
        if bar is not None:
            bar.update(len(ids) + 1)
        if total >= max_tokens - 16:
            break
    if bar is not None:
        bar.close()
    out = {k: np.concatenate(v) if v else np.zeros(0, np.uint32) for k, v in parts.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(out, str(tmp), metadata={"spec": json.dumps(spec)})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return {**out, "spec": spec, "path": str(path)}


def chunks(ids: np.ndarray, T: int) -> np.ndarray:
    """The corpus cut into [n, T] chunks (the tail that does not fill one dropped)."""
    n = len(ids) // T
    return ids[: n * T].reshape(n, T).astype(np.int64)

