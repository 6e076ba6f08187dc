"""The learned state of self-speculative decoding, in one owner.

:class:`SkipSetState` holds the skip-set optimizer (whose incumbent *is* the draft's skip set), the acceptance
statistics the speed gate learns, the outputs decoded so far (an n-gram source for later prompts; not persisted)
and ``tokens_seen``. The engine keeps one per model; a benchmark may keep
several side by side and pass each to ``eng.generate(..., state=...)``. It persists as JSON (``save``/``load``)
so a new process starts from what the last one learned (engine.py chooses the file per model, device and dtype).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from .atomic import write_json_atomic
from .config import OptimizerConfig
from .datastore import CONF_BINS, N_BUCKETS
from .errors import SwiftkError
from .ngram import OutputHistory
from .optimizer import SkipSetOptimizer

STATE_VERSION = 2
_BINS = 10
_NG_DECAY = 0.9


class AcceptanceStats:
    """P(the target agrees | the draft's probability for the token), per probability bin, and the same for n-gram
    candidates per match length; plus the gate's memory of how recent drafting rounds paid."""

    def __init__(self, max_n: int = 4):
        # prior: a token drafted with probability p is accepted with probability ~0.8 p (2 pseudo-observations)
        self.hits = [2 * 0.8 * (b + 0.5) / _BINS for b in range(_BINS)]
        self.tries = [2.0] * _BINS
        # by n-gram match length: a longer match repeats more reliably. A weak prior (2 pseudo-observations, 0.2 at
        # n=1 .. 0.5 at n=4): one miss or hit moves it past a CPU verify pass's break-even (~0.25-0.35), so chat that
        # never repeats stops paying for verify passes within a prompt (the earlier prior, 4 observations at
        # 0.25-0.7, kept 44 of 1,024 MT-Bench rounds verifying n-grams with 2 of 102 accepted)
        self.ng_tries = [2.0] * (max_n + 1)
        self.ng_hits = [2.0 * min(0.5, 0.1 + 0.1 * n) for n in range(max_n + 1)]
        # corpus n-grams (datastore.py), per (match length, share-of-followers bin): prior half the share bin's
        # middle, times 0.8 / 1.0 / 1.2 for n = 1 / 2 / 3 (Qwen2.5-Coder-0.5B HumanEval, offline: 0.0-0.56 by bucket;
        # MT-Bench 0.0-0.33), 2 pseudo-observations like the n-gram prior. Unlike the n-gram estimates these are kept
        # from prompt to prompt (new_text): how well the corpus fits is a property of the traffic (code or prose),
        # and with the same fast forgetting a change of kind is learned within ~10 proposals
        mids = [(lo + hi) / 2 for lo, hi in zip((0.0, *CONF_BINS), (*CONF_BINS, 1.0))]
        self.ds_tries = [2.0] * N_BUCKETS
        self.ds_hits = [2.0 * 0.5 * mids[b % len(mids)] * (0.8 + 0.2 * (b // len(mids))) for b in range(N_BUCKETS)]
        # the session's earlier outputs (ngram.OutputHistory), per match length: prior 0.1 at n=1 .. 0.4 at n=4, 2
        # pseudo-observations; kept from prompt to prompt like the corpus estimates (a model's habits of repeating
        # itself across answers belong to the traffic, not to one text), with the same fast forgetting
        self.hs_tries = [2.0] * (max_n + 1)
        self.hs_hits = [2.0 * min(0.4, 0.1 * max(n, 1)) for n in range(max_n + 1)]
        self.draft_rate: Optional[float] = None  # EMA of drafting rounds' speed, in plain-step units
        self.since_draft = 0
        self.probe_gap = 4
        self.ng_since = 0       # n-gram proposals declined since the last one verified
        self.ng_probe_gap = 4   # ... after which one is verified anyway (a probe), doubling while probes miss
        self.ng_probing = False

    def new_text(self) -> None:
        """A new prompt: whether text repeats itself is a property of that text (an extraction question copies from
        its prompt, a story does not), so the n-gram estimates restart from the prior and probing from its shortest
        gap, instead of carrying what earlier prompts taught (after a few chat prompts the probe gap had grown to
        128 proposals). A prompt that does not repeat pays a few missed proposals, each a verify pass of ~1.05-1.15
        steps."""
        fresh = AcceptanceStats(len(self.ng_hits) - 1)
        self.ng_hits, self.ng_tries = fresh.ng_hits, fresh.ng_tries
        self.ng_since, self.ng_probe_gap, self.ng_probing = 0, fresh.ng_probe_gap, False

    def calibrate(self, p: float) -> float:
        b = min(_BINS - 1, max(0, int(p * _BINS)))
        return self.hits[b] / self.tries[b]

    # Free sources (context n-grams, the session's earlier outputs, the corpus) keep (hits, tries) per key with fast
    # forgetting (memory ~10 proposals): whether text repeats itself changes within a prompt.
    def ngram_prob(self, n: int) -> float:
        return _rate(self.ng_hits, self.ng_tries, min(n, len(self.ng_hits) - 1))

    def observe_ngram(self, n: int, hit: bool) -> None:
        _forget(self.ng_hits, self.ng_tries, min(n, len(self.ng_hits) - 1), hit)

    def history_prob(self, n: int) -> float:
        return _rate(self.hs_hits, self.hs_tries, min(n, len(self.hs_hits) - 1))

    def observe_history(self, n: int, hit: bool) -> None:
        _forget(self.hs_hits, self.hs_tries, min(n, len(self.hs_hits) - 1), hit)

    def datastore_prob(self, b: int) -> float:
        return _rate(self.ds_hits, self.ds_tries, b)

    def observe_datastore(self, b: int, hit: bool) -> None:
        _forget(self.ds_hits, self.ds_tries, b, hit)

    def observe(self, p: float, hit: bool) -> None:
        b = min(_BINS - 1, max(0, int(p * _BINS)))
        self.hits[b] = 0.99 * self.hits[b] + hit   # slow forgetting: the text and the skip set change
        self.tries[b] = 0.99 * self.tries[b] + 1

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("hits", "tries", "ng_hits", "ng_tries", "draft_rate", "probe_gap",
                                              "ng_probe_gap")}

    def load_dict(self, d: dict) -> None:
        for k in ("hits", "tries", "ng_hits", "ng_tries"):
            v = [float(x) for x in d[k]]
            if len(v) != len(getattr(self, k)) or any(not 0 <= x < 1e6 for x in v):
                raise ValueError(f"bad {k}")
            setattr(self, k, v)
        self.draft_rate = None if d.get("draft_rate") is None else float(d["draft_rate"])
        self.probe_gap = int(d.get("probe_gap", 4))
        self.ng_probe_gap = min(128, max(1, int(d.get("ng_probe_gap", 4))))


def _rate(hits: list, tries: list, i: int) -> float:
    return hits[i] / tries[i]


def _forget(hits: list, tries: list, i: int, hit: bool) -> None:
    hits[i] = _NG_DECAY * hits[i] + hit
    tries[i] = _NG_DECAY * tries[i] + 1


class SkipSetState:
    def __init__(self, n_layers: int, cfg: Optional[OptimizerConfig] = None):
        self.n_layers = n_layers
        self.cfg = (cfg or OptimizerConfig()).validate()
        self.optimizer = SkipSetOptimizer(n_layers, self.cfg)
        self.stats = AcceptanceStats()
        self.history = OutputHistory()   # the outputs decoded with this state (in memory only, never saved)
        self.tokens_seen = 0
        self.time_decode_s = 0.0     # wall time decoded with this state (the optimization budget's base)
        self.time_optimize_s = 0.0
        self._dev = (None, None)

    @property
    def skip_set(self) -> torch.Tensor:
        """The draft's skip set: the optimizer's incumbent."""
        return self.optimizer.best

    @skip_set.setter
    def skip_set(self, s: torch.Tensor) -> None:
        self.optimizer.best = s.cpu().clone()

    def skip_set_on(self, device) -> torch.Tensor:
        """The skip set on ``device`` (copied once per set, not once per round)."""
        s = self.optimizer.best
        if self._dev[0] is not s:
            self._dev = (s, s.to(device))
        return self._dev[1]

    def use(self, skip: torch.Tensor, optimize: bool = False) -> None:
        """Decode with ``skip`` from now on; by default stop optimizing (the acceleration phase starts at once)."""
        self.skip_set = skip
        if not optimize:
            self.optimizer.finish()

    def optimization_allowed(self, estimate_s: float) -> bool:
        """The budget: optimization stays under ``opt_budget`` of the wall time decoded with this state."""
        if self.optimizer.done or self.cfg.opt_budget <= 0:
            return False
        return self.time_optimize_s + estimate_s <= self.cfg.opt_budget * max(self.time_decode_s, 1e-9) \
            or self.time_optimize_s == 0.0

    # ---- persistence
    def to_dict(self, identity: dict) -> dict:
        return {"version": STATE_VERSION, "model": identity, "n_layers": self.n_layers,
                "optimizer_config": {k: getattr(self.cfg, k) for k in self.cfg.__dataclass_fields__},
                "optimizer": self.optimizer.to_dict(), "stats": self.stats.to_dict(),
                "tokens_seen": self.tokens_seen, "time_decode_s": self.time_decode_s,
                "time_optimize_s": self.time_optimize_s}

    def save(self, path, identity: dict, extra: Optional[dict] = None) -> None:
        write_json_atomic(path, {**self.to_dict(identity), **(extra or {})})

    @classmethod
    def load(cls, path, identity: dict, n_layers: int, cfg: Optional[OptimizerConfig] = None) -> "SkipSetState":
        """Rebuild a saved state; SwiftkError names what is wrong (missing, corrupt, another model's)."""
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SwiftkError(f"cannot read decoding state {path}: {e}") from None
        if not isinstance(d, dict) or d.get("version") != STATE_VERSION:
            raise SwiftkError(f"{path} is not a swiftk decoding state (version {STATE_VERSION})")
        if d.get("model") != identity or d.get("n_layers") != n_layers:
            raise SwiftkError(f"decoding state {path} is for another model ({(d.get('model') or {}).get('name')!r})")
        st = cls(n_layers, cfg or OptimizerConfig())
        try:
            if cfg is None or d.get("optimizer_config") == st.to_dict(identity)["optimizer_config"]:
                st.optimizer.load_dict(d["optimizer"])   # the search continues only under the same options
            st.stats.load_dict(d["stats"])
            st.tokens_seen = int(d.get("tokens_seen", 0))
            st.time_decode_s = float(d.get("time_decode_s", 0.0))
            st.time_optimize_s = float(d.get("time_optimize_s", 0.0))
        except (KeyError, TypeError, ValueError) as e:
            raise SwiftkError(f"decoding state {path} is corrupt: {e}") from None
        return st
