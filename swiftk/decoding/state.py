"""The learned state: what decoding learns and carries from one prompt to the next, in one owner.

It holds the skip-set search (whose incumbent *is* the layer-skip draft's skip set), the calibration of draft
probabilities into acceptance chances, the gate's memory of how drafting rounds paid, the estimates of the free
sources that carry across prompts (session history, corpus), the session's earlier outputs, and counters. The
engine keeps one per method (and per fixed skip set); a benchmark may pass its own with ``generate(..., state=)``.

Serialised whole and versioned (``to_dict`` / ``from_dict``): a round trip through a file gives back every learned
estimate. What belongs to one text (context n-gram estimates, probing) lives in the call and is never saved; the
session's outputs are user data and stay in memory.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..atomic import write_json_atomic
from ..options import OptimizerConfig, option_names, split_options, updated
from ..errors import SwiftkError, warn
from ..files import check_output_path, read_json
from ..home import swiftk_home
from ..proposers.suffix import OutputHistory
from ..proposers.layerskip.search import SkipSetOptimizer
from ..proposers.base import Estimates, calibration_bin, new_calibration  # noqa: F401
from ..proposers.recycle import SuccessorTable
from ..runtime import skipset

STATE_VERSION = 3


@dataclass
class GateMemory:
    """How recent model-drafting rounds paid (gate.Gate writes it, nothing else does): an EMA of their speed in
    plain-step units, rounds since the last draft, the gap after which a losing drafter is probed again, and what
    free-only rounds measured against the free sources' estimate (beside a model drafter)."""

    draft_rate: Optional[float] = None
    since_draft: int = 0
    probe_gap: int = 4
    free_bias: float = 1.0

    def to_dict(self) -> dict:
        return {"draft_rate": self.draft_rate, "since_draft": self.since_draft, "probe_gap": self.probe_gap,
                "free_bias": self.free_bias}

    @staticmethod
    def from_dict(d: dict) -> "GateMemory":
        rate = d.get("draft_rate")
        if rate is not None and not (isinstance(rate, (int, float)) and math.isfinite(rate) and 0 <= rate < 1e3):
            raise ValueError(f"bad draft_rate {rate!r}")
        bias = d.get("free_bias", 1.0)
        if isinstance(bias, bool) or not (isinstance(bias, (int, float)) and math.isfinite(bias) and 0.25 <= bias <= 4):
            raise ValueError(f"bad free_bias {bias!r}")
        return GateMemory(None if rate is None else float(rate), min(10**6, max(0, int(d.get("since_draft", 0)))),
                          min(128, max(1, int(d.get("probe_gap", 4)))), float(bias))


class LearnedState:
    def __init__(self, n_layers: int, cfg: Optional[OptimizerConfig] = None):
        self.n_layers = n_layers
        self.cfg = (cfg or OptimizerConfig()).validate()
        self.optimizer = SkipSetOptimizer(n_layers, self.cfg)
        self.calibration = new_calibration()
        self.gate = GateMemory()
        self.estimates: dict = {}           # free source name -> Estimates (those with carries = True)
        self.history = OutputHistory()      # the outputs decoded with this state (in memory only, never saved)
        self._successors = None             # Token Recycling's table (in memory only), made at first use
        self.tokens_seen = 0
        self.time_decode_s = 0.0            # wall time decoded with this state (the search budget's base)
        self.time_optimize_s = 0.0

    @property
    def skip_set(self):
        """The layer-skip draft's skip set: the search's incumbent."""
        return self.optimizer.best

    @skip_set.setter
    def skip_set(self, s) -> None:
        self.optimizer.best = s.cpu().clone()

    def use(self, skip, optimize: bool = False) -> None:
        """Decode with ``skip`` from now on; by default stop optimizing (the acceleration phase starts at once)."""
        self.skip_set = skip
        if not optimize:
            self.optimizer.finish()

    def successors(self, vocab: int):
        """Token Recycling's successor table for a ``vocab``-token model (made at first use; in memory only)."""
        if self._successors is None or self._successors.table.shape[0] != vocab:
            self._successors = SuccessorTable(vocab)
        return self._successors

    def source_estimates(self, name: str, make: Callable[[], Estimates]) -> Estimates:
        """The carried estimates of free source ``name`` (made by ``make`` at first use, or after a saved table of
        another shape)."""
        est, fresh = self.estimates.get(name), make()
        if est is None or len(est) != len(fresh):
            est = self.estimates[name] = fresh
        return est

    # ---- persistence
    def to_dict(self, identity: dict) -> dict:
        return {"version": STATE_VERSION, "model": identity, "n_layers": self.n_layers,
                "optimizer_config": {k: getattr(self.cfg, k) for k in self.cfg.__dataclass_fields__},
                "optimizer": self.optimizer.to_dict(), "calibration": self.calibration.to_dict(),
                "gate": self.gate.to_dict(),
                "estimates": {k: {**v.to_dict(), "decay": v.decay} for k, v in sorted(self.estimates.items())},
                "tokens_seen": self.tokens_seen, "time_decode_s": self.time_decode_s,
                "time_optimize_s": self.time_optimize_s}

    @classmethod
    def from_dict(cls, d: dict, identity: dict, n_layers: int, cfg: Optional[OptimizerConfig] = None,
                  where: str = "decoding state") -> "LearnedState":
        """Rebuild a saved state; SwiftkError names what is wrong (not a state, another model's, corrupt)."""
        if not isinstance(d, dict) or d.get("version") != STATE_VERSION:
            raise SwiftkError(f"{where} is not a swiftk decoding state (version {STATE_VERSION})")
        if d.get("model") != identity or d.get("n_layers") != n_layers:
            raise SwiftkError(f"{where} is for another model ({(d.get('model') or {}).get('name')!r})")
        st = cls(n_layers, cfg or OptimizerConfig())
        try:
            if cfg is None or d.get("optimizer_config") == st.to_dict(identity)["optimizer_config"]:
                st.optimizer.load_dict(d["optimizer"])   # the search continues only under the same options
            st.calibration.load_dict(d["calibration"])
            st.gate = GateMemory.from_dict(d["gate"])
            for name, e in d["estimates"].items():
                decay = float(e["decay"])
                if not 0 < decay < 1:
                    raise ValueError(f"bad decay {decay!r}")
                est = Estimates([0.0] * len(e["hits"]), decay=decay)
                est.load_dict(e)
                st.estimates[str(name)] = est
            st.tokens_seen = max(0, int(d["tokens_seen"]))
            st.time_decode_s, st.time_optimize_s = float(d["time_decode_s"]), float(d["time_optimize_s"])
            if not all(math.isfinite(x) and 0 <= x < 1e9 for x in (st.time_decode_s, st.time_optimize_s)):
                raise ValueError("decode/optimize times out of range")
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError, SwiftkError) as e:
            raise SwiftkError(f"{where} is corrupt: {e}") from None
        return st

    def save(self, path, identity: dict, extra: Optional[dict] = None) -> None:
        write_json_atomic(path, {**self.to_dict(identity), **(extra or {})})

    @classmethod
    def load(cls, path, identity: dict, n_layers: int, cfg: Optional[OptimizerConfig] = None) -> "LearnedState":
        d = read_json(path, "decoding state")   # no NaN/Infinity, UTF-8, an object
        return cls.from_dict(d, identity, n_layers, cfg, where=f"decoding state {path}")


SkipSetState = LearnedState   # the name before draft sources were pluggable


def state_file(identity: dict, device, dtype, weights, activations=None) -> Path:
    """``$SWIFTK_HOME/state/<model>-<fingerprint>-<device>-<dtype>.json``: one file per model, device, dtype and
    numerical model (weight format, activation arithmetic: the cost model and what drafts pay differ)."""
    fp = hashlib.sha256(repr(sorted(identity.items())).encode()).hexdigest()[:12]
    name = "".join(c if c.isalnum() or c in "-._" else "_" for c in str(identity.get("name") or "model"))
    kind = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device).replace(" ", "_")
    dt = (str(dtype).replace("torch.", "") + (f"-w{weights}" if weights else "")
          + (f"-a{activations}" if activations and activations != "float32" else ""))
    return swiftk_home() / "state" / f"{name}-{fp}-{kind}-{dt}.json"


def load_persisted(path, identity: dict, n_layers: int, cfg, costs) -> Optional[LearnedState]:
    """The saved state (and, when measured with as many threads, the cost model into ``costs``); None with a
    warning when the file is damaged or another model's."""
    try:
        st = LearnedState.load(path, identity, n_layers, cfg)
        saved = read_json(path, "decoding state").get("costs") or {}
        if saved.get("threads") == torch.get_num_threads():
            costs.load_dict(saved)
        return st
    except (SwiftkError, ValueError, TypeError, ArithmeticError, AttributeError, OSError) as e:
        warn(f"swiftk: ignoring the saved decoding state {path} ({e}); starting fresh")
        return None


class LearnedStates:
    """An engine's learned states, one owner: SWIFT's (``main``: kept in ``path`` across processes where the engine
    persists) and a few other methods' (fixed drafts learn their own), the most recently used kept."""
    KEEP = 8

    def __init__(self, n_layers: int, cfg: OptimizerConfig, identity: dict, path: Optional[Path], target):
        """``target``: the swiftk.target.Target whose cost model a saved state carries (and a loaded one restores)."""
        self.n_layers, self.identity, self.path, self.target = n_layers, identity, path, target
        self.main = LearnedState(n_layers, cfg)
        self._others: dict = {}
        self._warned = False

    def new(self, cfg: OptimizerConfig) -> LearnedState:
        return LearnedState(self.n_layers, cfg)

    def reset(self, optimizer_options: dict) -> None:
        """Forget what SWIFT's state learned: the uniform skip set and a fresh optimizer (with these options)."""
        dec, _ = split_options(optimizer_options)   # unknown names raise
        if dec:
            raise SwiftkError(f"{', '.join(sorted(dec))}: decode option(s), give them to generate(), not "
                              "reset_optimizer()")
        self.main = self.new(updated(self.main.cfg, optimizer_options))

    def of(self, key) -> LearnedState:
        """The state of a method's key (None: SWIFT's, ``main``)."""
        if key is None:
            return self.main
        st = self._others.pop(key, None) or LearnedState(self.n_layers, self.main.cfg)
        self._others[key] = st  # most recently used last
        while len(self._others) > self.KEEP:
            del self._others[next(iter(self._others))]
        return st

    def load(self, cfg: Optional[OptimizerConfig]) -> None:
        """``main`` from ``path`` where one was saved (``cfg``: optimizer options that override the saved ones)."""
        if self.path is not None and self.path.exists():
            self.main = load_persisted(self.path, self.identity, self.n_layers, cfg, self.target.costs) or self.main

    def save(self) -> None:
        """``main`` and the cost model to ``path`` (where persisting); a failure warns once and decoding goes on."""
        if self.path is None:
            return
        try:
            self.main.save(self.path, self.identity,
                           {"costs": {**self.target.costs.to_dict(), "threads": torch.get_num_threads()}})
        except (OSError, SwiftkError) as e:
            if not self._warned:
                self._warned = True
                warn(f"swiftk: cannot save the decoding state ({e}); continuing without")

    # ------------------------------------------------------------------ skip sets, as files and by layer
    def save_skip_set(self, path, skip_set: Optional[torch.Tensor] = None, **extra) -> None:
        """``skip_set`` (default: SWIFT's incumbent, with its matchness) to a JSON file tied to this model."""
        check_output_path(path, "skip-set file")
        if skip_set is None:
            skip_set = self.main.skip_set
            extra.setdefault("matchness", self.main.optimizer.best_matchness)
        skipset.save(path, skip_set, self.identity, **extra)

    def read_skip_set(self, path) -> torch.Tensor:
        return skipset.read(path, self.identity, self.n_layers)

    def load_skip_set(self, path, optimize: bool = False) -> None:
        """Use a saved skip set in SWIFT's state; by default stop optimizing (the acceleration phase starts at once)."""
        self.main.use(self.read_skip_set(path), optimize=optimize)

    def from_layers(self, attention, mlp) -> torch.Tensor:
        """A skip set [2L] from the attention and MLP layers to skip (static drafts: ``generate(skip_set=)``)."""
        return skipset.from_layers(self.n_layers, attention, mlp)

    def early_exit(self, exit_layer: int) -> torch.Tensor:
        return skipset.early_exit(self.n_layers, exit_layer)

    def info(self) -> dict:
        o = self.main.optimizer
        return {"optimizer_config": {k: getattr(self.main.cfg, k) for k in sorted(option_names(OptimizerConfig))},
                "state": {"skip_set": skipset.to_layers(self.main.skip_set), "tokens_seen": self.main.tokens_seen,
                          "optimization_steps": o.steps, "optimization_done": o.done,
                          "best_matchness": o.best_matchness, "file": str(self.path) if self.path else None}}
