"""The Python standard library as a corpus every machine has, with no download: one home for both cuts of it.

- ``stdlib_docs``: every module (sorted paths, test suites excluded), tokenized: the corpus n-gram tables
  (datastore.py) and the MoA drafter's training data (swiftk.moa.data).
- ``head_corpus_texts``: the top-level modules only, the first 32 KiB of each, about 3 MB: the draft head's token
  ranking (draft_head.py). A different cut on purpose: the cached rankings and their fingerprint are keyed on it,
  and changing it would change which tokens the draft head can propose.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

_CORPUS_FILE_BYTES = 32 * 1024  # per file: many modules, not a few huge ones
_CORPUS_TOTAL_BYTES = 3 * 1024 * 1024


def stdlib_files() -> list:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "ensurepip")
    return sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts[:-1]) & set(skip))


def stdlib_docs(tokenizer, batch: int = 64):
    """Token ids of each readable stdlib module, in path order (the corpus of the drafter and of datastore.py);
    ``batch`` modules at a time through the tokenizer's batch encoding when it has one."""
    texts = []
    for p in stdlib_files():
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        if len(texts) == batch:
            yield from _encode_all(tokenizer, texts)
            texts = []
    yield from _encode_all(tokenizer, texts)


def _encode_all(tokenizer, texts: list):
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(t, add_bos=False) for t in texts]


def head_corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"))


def head_corpus_texts():
    total = 0
    for f in head_corpus_files():
        try:
            text = f.read_text(encoding="utf-8", errors="replace")[:_CORPUS_FILE_BYTES]
        except OSError:
            continue
        cut = text.rfind("\n")  # end on a line boundary so the last token is a natural one
        text = text[: cut + 1] if cut > 0 else text
        yield text
        total += len(text)
        if total >= _CORPUS_TOTAL_BYTES:
            return
