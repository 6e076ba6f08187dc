"""Corpus n-gram drafting: guess the next tokens from what followed the same last tokens in a fixed corpus.

Prompt lookup (ngram.py) has nothing to copy until the text repeats itself; a corpus of the same kind of text often
has: after ``for i in`` comes `` range``. The corpus here is the Python standard library's own
source, which every Python install ships, so the tables are reproducible from the interpreter alone (the idea of
retrieval drafting, REST, He et al. 2024; here exact n-gram tables instead of a suffix array). The drafts are free
(a table lookup), so a first token right a small share of the time already pays for its share of a verify pass;
the speed gate (costs.py) learns per table and confidence how often they are right
and drafts only where that pays. Verification is the target's, as for every draft: output stays lossless.

Tables, one per n in 1..MAX_N: key = the n tokens packed in 21 bits each (vocabularies up to 2M tokens) ->
(the token that most often followed, its count, how often the key occurred), for keys seen >= MIN_COUNT times;
sorted keys, looked up with np.searchsorted. Built once per tokenizer (model fingerprint) from the first
``max_tokens`` corpus tokens and kept as .npz under $SWIFTK_HOME/datastore (no pickle; temp name, then rename).
"""
from __future__ import annotations

import hashlib
import io
import os
import sys
import sysconfig
import threading
import zipfile
from pathlib import Path
from typing import Optional

import numpy as np

from ..atomic import write_atomic
from ..background import Background, Stopped, check
from ..errors import SwiftkError, warn
from ..files import regular_file
from ..home import swiftk_home
from ..target import Target
from .stdlib import stdlib_docs

MAX_N = 3
MIN_COUNT = 2
BITS = 21
FORMAT = 2   # 2: the tables carry their tokenizer's fingerprint
DEFAULT_MAX_TOKENS = 3_000_000
CONF_BINS = (0.25, 0.5, 0.75)   # share of the key's occurrences followed by the proposed token -> bin 0..3


def bucket(n: int, share: float) -> int:
    """Statistics bucket of a proposal: (match length, confidence bin) -> 0 .. MAX_N * 4 - 1."""
    return (n - 1) * (len(CONF_BINS) + 1) + sum(share >= b for b in CONF_BINS)


N_BUCKETS = MAX_N * (len(CONF_BINS) + 1)


def _pack(ids: np.ndarray, n: int) -> np.ndarray:
    """Keys of the n-grams ending at positions n-1 .. len-1 of ``ids``."""
    L = len(ids) - n + 1
    key = np.zeros(max(L, 0), dtype=np.int64)
    for j in range(n):
        key = (key << BITS) | ids[j:j + L]
    return key


class Datastore:
    """Exact n-gram tables over a token corpus; ``propose`` continues a context greedily from them."""

    def __init__(self, tables: dict):
        self.tables = tables   # n -> (keys int64 sorted, next token int64, its count int64, key count int64)
        self._native: object = None   # the compiled walk (cpu_ngram.NgramTables), made on first use; False: none

    def _compiled(self):
        if self._native is None:
            from ..runtime.ops.cpu_ngram import ngram_tables   # where the CPU kernel library is already loaded
            n = min(MAX_N, len(self.tables))   # the walk's reach (lookup's)
            self._native = ngram_tables({i: self.tables[i] for i in range(1, n + 1)}, BITS) or False
        return self._native

    @classmethod
    def build(cls, token_ids, max_n: int = MAX_N, min_count: int = MIN_COUNT) -> "Datastore":
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= 1 << BITS)):
            raise SwiftkError(f"datastore: token ids must be a flat list in [0, 2^{BITS})")
        tables = {}
        for n in range(1, max_n + 1):
            if len(ids) <= n:
                tables[n] = tuple(np.zeros(0, dtype=np.int64) for _ in range(4))
                continue
            k, nxt = _pack(ids[:-1], n), ids[n:]        # n-gram ending at i, the token after it
            order = np.lexsort((nxt, k))
            k, nxt = k[order], nxt[order]
            pair_start = np.flatnonzero(np.r_[True, (k[1:] != k[:-1]) | (nxt[1:] != nxt[:-1])])
            pair_count = np.diff(np.r_[pair_start, len(k)])
            pk, pn = k[pair_start], nxt[pair_start]
            key_start = np.flatnonzero(np.r_[True, pk[1:] != pk[:-1]])
            total = np.add.reduceat(pair_count, key_start)
            best = np.lexsort((pn, -pair_count, pk))      # per key: most frequent next token first (ties: lowest id)
            tok, cnt = pn[best][key_start], pair_count[best][key_start]
            keep = total >= min_count
            tables[n] = (pk[key_start][keep], tok[keep], cnt[keep], total[keep])
        return cls(tables)

    def max_token(self) -> int:
        """The largest token id the tables can propose (-1 when empty)."""
        return max((int(t[1].max()) for t in self.tables.values() if len(t[1])), default=-1)

    def max_id(self) -> int:
        """The largest token id anywhere in the tables: proposed, or in a key (-1 when empty)."""
        out = self.max_token()
        for n, (keys, *_rest) in self.tables.items():
            if len(keys):
                mask = (1 << BITS) - 1
                out = max(out, *(int(((keys >> (BITS * j)) & mask).max()) for j in range(n)))
        return out

    def __len__(self) -> int:
        return sum(len(t[0]) for t in self.tables.values())

    def lookup(self, context: list) -> Optional[tuple]:
        """(next token, match length n, share of the n-gram's occurrences it followed) for the longest known suffix
        of ``context``, or None."""
        for n in range(min(MAX_N, len(self.tables), len(context)), 0, -1):
            keys, tok, cnt, tot = self.tables[n]
            if not len(keys):
                continue
            key = 0
            for t in context[-n:]:
                if not 0 <= t < 1 << BITS:
                    return None
                key = (key << BITS) | int(t)
            i = int(np.searchsorted(keys, key))
            if i < len(keys) and int(keys[i]) == key:
                return int(tok[i]), n, float(cnt[i]) / float(tot[i])
        return None

    def propose(self, context: list, k: int, prob=None, floor: float = 0.0, probs: Optional[list] = None) -> tuple:
        """Up to ``k`` tokens continuing ``context`` (each the most frequent follower of the longest known suffix),
        and the statistics bucket of each. Empty when the last token was never seen. With ``prob`` (bucket ->
        estimated acceptance) the chain stops before its cumulative estimate falls below ``floor`` (after its first
        token); ``probs``: the same as a list per bucket (one call fewer per bucket). Compiled
        (kernels/cpu/cpu_ngram.cpp) where the kernel library is loaded; :meth:`walk` is its twin."""
        if prob is not None and probs is None:
            probs = [prob(b) for b in range(N_BUCKETS)]
        native = self._compiled() if k <= 64 else None
        if native:
            return native.propose(context[-MAX_N:], k, probs, floor)
        return self.walk(context, k, None if probs is None else probs.__getitem__, floor)

    def walk(self, context: list, k: int, prob=None, floor: float = 0.0) -> tuple:
        """:meth:`propose` in Python."""
        ctx, toks, buckets = list(context[-MAX_N:]), [], []
        value = 1.0
        for _ in range(k):
            got = self.lookup(ctx)
            if got is None:
                break
            t, n, share = got
            b = bucket(n, share)
            if prob is not None:
                value *= prob(b)
                if toks and value < floor:   # the first token stays: the gate's probes need one to verify
                    break
            toks.append(t)
            buckets.append(b)
            ctx = ctx[1:] + [t] if len(ctx) >= MAX_N else ctx + [t]
        return toks, buckets

    # ---- persistence
    def save(self, path: Path, fingerprint: str = "") -> None:
        arrays = {f"{name}{n}": a for n, t in self.tables.items() for name, a in zip(("keys", "tok", "cnt", "tot"), t)}
        arrays["format"] = np.array([FORMAT, MAX_N, BITS], dtype=np.int64)
        arrays["fingerprint"] = np.frombuffer(fingerprint.encode(), dtype=np.uint8)

        buf = io.BytesIO()
        np.savez(buf, **arrays)
        write_atomic(path, buf.getvalue())

    @classmethod
    def load(cls, path: Path, fingerprint: Optional[str] = None, vocab_size: Optional[int] = None) -> "Datastore":
        """The tables in ``path``, checked: the format, every invariant the lookup relies on, and (when given) the
        tokenizer they were built with and the vocabulary of the model that reads them. SwiftkError names what is
        wrong."""
        try:
            with open(regular_file(path, "corpus table"), "rb") as f, np.load(f, allow_pickle=False) as z:
                if [int(x) for x in z["format"]] != [FORMAT, MAX_N, BITS]:
                    raise SwiftkError(f"datastore {path}: unknown format")
                tables = {n: tuple(np.asarray(z[f"{name}{n}"], dtype=np.int64) for name in ("keys", "tok", "cnt", "tot"))
                          for n in range(1, MAX_N + 1)}
                made_for = bytes(np.asarray(z["fingerprint"], dtype=np.uint8)).decode(errors="replace")
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            raise SwiftkError(f"datastore {path}: not a corpus table swiftk wrote ({type(e).__name__}: {e})") from None
        if fingerprint is not None and made_for != fingerprint:
            raise SwiftkError(f"datastore {path}: built for another tokenizer")
        if fingerprint is not None and not len(tables[1][0]):   # a corpus never yields no unigram
            raise SwiftkError(f"datastore {path}: its tables are empty")
        for n, (keys, tok, cnt, tot) in tables.items():
            # what lookup() divides by and searches in: counts 1 <= cnt <= tot, sorted keys of n ids, ids in range
            ok = len(keys) == len(tok) == len(cnt) == len(tot) and (not len(keys) or (
                np.all(keys[1:] > keys[:-1]) and keys[0] >= 0 and keys[-1] < 1 << (BITS * n)
                and tok.min() >= 0 and tok.max() < 1 << BITS and cnt.min() >= 1 and np.all(cnt <= tot)))
            if not ok:
                raise SwiftkError(f"datastore {path}: corrupt tables (n={n})")
        ds = cls(tables)
        if vocab_size is not None and ds.max_id() >= vocab_size:
            raise SwiftkError(f"datastore {path}: holds token id {ds.max_id()}, outside this model's vocabulary "
                              f"({vocab_size} tokens)")
        return ds


def stdlib_ids(tokenizer, max_tokens: int) -> list:
    """The corpus: the standard library's modules in path order (test suites excluded), joined by EOS."""
    eos = min(tokenizer.eos_ids) if tokenizer.eos_ids else 0
    out: list = []
    for ids in stdlib_docs(tokenizer):
        check()   # between batches: the interpreter may be exiting (swiftk/background.py)
        if len(out) >= max_tokens:
            break
        out.extend(ids[: max_tokens - len(out)])
        out.append(eos)
    return out[:max_tokens]


_lock = threading.Lock()


def _table_path(fingerprint: str, max_tokens: int) -> Path:
    tag = hashlib.sha256(f"{fingerprint}|{sys.version_info[:2]}|{sysconfig.get_paths()['stdlib']}|{max_tokens}|"
                         f"{FORMAT}|{MAX_N}|{MIN_COUNT}".encode()).hexdigest()[:16]
    return Path(swiftk_home()) / "datastore" / f"stdlib-{tag}.npz"


def cached_stdlib_datastore(fingerprint: str, vocab_size: int, max_tokens: int = DEFAULT_MAX_TOKENS,
                            ) -> Optional[Datastore]:
    """The stdlib tables of this tokenizer when $SWIFTK_HOME/datastore holds them (~0.1 s), else None. A table that
    fails its checks is removed, with one warning naming it, so that it is rebuilt."""
    if not fingerprint:
        return None
    with _lock:
        return _load_cached(_table_path(fingerprint, max_tokens), fingerprint, vocab_size)


def _load_cached(path: Path, fingerprint: str, vocab_size: int) -> Optional[Datastore]:
    if not os.path.lexists(path):
        return None
    try:
        ds = Datastore.load(path, fingerprint, vocab_size)
        os.utime(path)   # most recently used: evicted last
        return ds
    except Exception as e:  # noqa: BLE001 - swiftk's own cache, unusable however (damaged, not a file): rebuild
        try:
            if not os.path.isdir(path):
                os.unlink(path)
        except OSError:
            pass
        warn(f"swiftk: rebuilding the corpus table {path}: {str(e)[:300]}")
        return None


def stdlib_datastore(tokenizer, fingerprint: str, vocab_size: int, max_tokens: int = DEFAULT_MAX_TOKENS) -> Datastore:
    """The stdlib tables for this tokenizer, from $SWIFTK_HOME/datastore when built before (build: a few seconds
    to ~30 s once, by the tokenizer's speed)."""
    if not fingerprint:   # no identity to key a cached file on: build in memory
        return Datastore.build(stdlib_ids(tokenizer, max_tokens))
    path = _table_path(fingerprint, max_tokens)
    with _lock:   # threads of one process build it once
        ds = _load_cached(path, fingerprint, vocab_size)
        if ds is not None:
            return ds
        ids = stdlib_ids(tokenizer, max_tokens)
        check()
        ds = Datastore.build(ids)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            ds.save(path, fingerprint)
            _evict(path.parent, keep=MAX_CACHED)
        except OSError as e:   # a read-only cache: keep the tables in memory for this process
            print(f"swiftk: datastore not cached ({e})", file=sys.stderr)
        return ds


MAX_CACHED = 4   # corpus tables kept in $SWIFTK_HOME/datastore (~15 MB each), one per tokenizer


def _evict(folder: Path, keep: int) -> None:
    """Delete all but the ``keep`` most recently used tables."""
    tables = sorted(folder.glob("stdlib-*.npz"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in tables[keep:]:
        old.unlink(missing_ok=True)


__all__ = ["Datastore", "stdlib_datastore", "cached_stdlib_datastore", "bucket", "N_BUCKETS"]


def corpus_fingerprint(tokenizer, identity: dict) -> str:
    """What the tables are keyed by: the tokenizer (shared by model files with one tokenizer; a duck-typed one: the
    model file)."""
    return tokenizer.fingerprint() if hasattr(tokenizer, "fingerprint") else str(identity.get("fingerprint") or "")


def engine_corpus(tokenizer, identity: dict, vocab_size: int) -> tuple:
    """(tables, None) for an engine's tokenizer; (empty tables that propose nothing, the warning to give) when the
    tokenizer cannot encode the corpus or maps it past the model's vocabulary (a custom tokenizer). The caller warns:
    this may run on a background thread, where a warning would reach nobody's filters."""
    try:
        ds = stdlib_datastore(tokenizer, corpus_fingerprint(tokenizer, identity), vocab_size)
        if ds.max_token() >= vocab_size:
            raise SwiftkError(f"the corpus maps to token ids >= the model's vocabulary ({vocab_size})")
        return ds, None
    except Stopped:
        raise
    except Exception as e:  # noqa: BLE001 - the corpus is an optional source, never a reason to fail
        return Datastore.build([]), (f"swiftk: corpus n-grams unavailable ({type(e).__name__}: {str(e)[:200]}); "
                                     "decoding without them")


# ---------------------------------------------------------------- one engine's tables
class CorpusTables:
    """The corpus tables a target's calls draft from (one per engine, kept as the target's "corpus" resource once
    ready): loaded from the cache, or built in a background thread, here beside the tables they load and build."""

    def __init__(self, target: Target):
        self.target = target
        self._job: Optional[Background] = None   # the tables' build, started by start()

    def get(self, wait: bool = False) -> Datastore:
        """The corpus n-gram tables the "datastore" source drafts from: unless :meth:`use` gave others, over the
        Python stdlib, read from ``$SWIFTK_HOME/datastore``. Tables not built yet are built in the background
        (started at load, at low priority); until they are ready this returns empty tables, so no call waits for
        them (``swiftk pull`` builds them with the download). ``wait``: block until they are ready (benchmarks:
        every arm drafts from the same sources, no build runs beside a timing)."""
        got = self.target.resource("corpus")
        if got is not None:
            return got
        job = self._job or self.start()
        if job is None:   # found in the cache
            return self.target.resource("corpus")
        if wait:
            job.join()
        if job.is_alive():
            return Datastore.build([])
        if job.result is None and job.error is None:   # a forked parent's job, never run in this process
            self._job = None
            return self.get(wait)
        ds, problem = job.result if job.result is not None else (Datastore.build([]), f"swiftk: {job.error}")

        def ready():
            if problem:
                warn(problem)   # once, in the caller's thread
            return ds

        return self.target.resource("corpus", ready)

    def start(self) -> Optional[Background]:
        """Load the cached tables now (~0.1 s; returns None), or start a daemon thread building them at the lowest
        priority (returns it)."""
        t = self.target
        ds = cached_stdlib_datastore(corpus_fingerprint(t.tokenizer, t.identity), t.config.vocab_size)
        if ds is not None:
            t.set_resource("corpus", ds)
            return None
        self._job = Background(lambda: engine_corpus(t.tokenizer, t.identity, t.config.vocab_size),
                               name="swiftk-corpus", low_priority=True)
        return self._job

    def use(self, datastore) -> None:
        """Draft corpus n-grams from ``datastore`` (``swiftk.proposers.datastore.Datastore.build(token_ids)``)."""
        if not isinstance(datastore, Datastore):
            raise SwiftkError("use_corpus takes a swiftk.proposers.datastore.Datastore, got "
                              f"{type(datastore).__name__}")
        if datastore.max_token() >= self.target.config.vocab_size:
            raise SwiftkError(f"the corpus holds token ids >= the model's vocabulary ({self.target.config.vocab_size})")
        self.target.set_resource("corpus", datastore)
