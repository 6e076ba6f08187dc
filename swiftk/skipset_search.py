"""Self-SD static mode: search a skip set offline, before serving (Zhang et al., "Draft & Verify").

Unlike SWIFT's on-the-fly search (matchness on the model's own recent output), the objective here is what a user
wants: measured tokens/s of self-speculative greedy generation on calibration prompts with the candidate set.
Bayesian optimization (``bayesian-optimization``: GP + UCB) runs over one coordinate in [0, 1] per skippable
sublayer; a coordinate > 0.5 skips that sublayer. The first ``n_init`` points are random. Every evaluated point is
appended to a state file (written atomically), so an interrupted search resumes where it stopped; the best set
found is written in the same JSON format as ``LearnedStates.save_skip_set`` and is used with ``method="static"``.
An application of the engine beside the CLI (it decodes with ``Engine.generate``), not a draft source.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from .atomic import write_json_atomic
from .engine import Engine
from .errors import SwiftkError
from .files import read_json, read_text

STATE_VERSION = 1


def read_prompts(path) -> list:
    """Calibration prompts: ``.jsonl`` (objects with "prompt", "text" or "turns") or one prompt per line."""
    text = read_text(path, "prompts file")
    out = []
    if Path(path).suffix == ".jsonl":
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise SwiftkError(f"{path}:{i}: not JSON: {e}") from None
            turns = obj.get("turns") if isinstance(obj, dict) else None
            first = turns[0] if isinstance(turns, list) and turns else None
            val = obj.get("prompt", obj.get("text", first)) if isinstance(obj, dict) else obj
            if not isinstance(val, str) or not val.strip():
                raise SwiftkError(f"{path}:{i}: expected a string prompt (keys prompt, text or turns)")
            out.append(val)
    else:
        out = [line for line in text.splitlines() if line.strip()]
    if not out:
        raise SwiftkError(f"prompts file {path} holds no prompt")
    return out


class OfflineSearch:
    def __init__(self, engine: Engine, prompts: Sequence, *, iterations: int = 30, n_init: int = 8,
                 max_new_tokens: int = 64, chat: bool = False, state_path=None, seed: int = 0,
                 kappa: float = 2.5):
        if iterations < 1 or n_init < 1 or max_new_tokens < 1:
            raise SwiftkError("iterations, n_init and max_new_tokens must be >= 1")
        if not prompts:
            raise SwiftkError("no calibration prompts")
        self.eng = engine
        L = engine.config.n_layers
        if L < 3:
            raise SwiftkError(f"layer skipping needs at least 3 layers, the model has {L}")
        # the first and last layer are never skipped (as in SWIFT)
        self.coords = list(range(2, 2 * L - 2))
        self.ids = [engine.encode_prompt(p, chat=chat) for p in prompts]
        self.iterations, self.n_init, self.max_new = iterations, n_init, max_new_tokens
        self.seed, self.kappa = seed, kappa
        self.state_path = Path(state_path) if state_path else None
        self.history: list = []  # {"x": [...], "tokens_per_s": float, "M": float, "alpha": float}
        if self.state_path is not None and self.state_path.exists():
            self._resume()

    def _resume(self) -> None:
        st = read_json(self.state_path, "search state")
        if st.get("version") != STATE_VERSION:
            raise SwiftkError(f"{self.state_path} is not a swiftk search state (version {STATE_VERSION})")
        if st.get("model") != self.eng.identity.get("name") or st.get("n_coords") != len(self.coords):
            raise SwiftkError(f"search state {self.state_path} is for model {st.get('model')!r}, not "
                              f"{self.eng.identity.get('name')!r}")
        hist = st.get("history", [])
        ok = isinstance(hist, list) and all(
            isinstance(h, dict) and isinstance(h.get("x"), list) and len(h["x"]) == len(self.coords)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in h["x"])
            and all(isinstance(h.get(k), (int, float)) and math.isfinite(h[k]) for k in ("tokens_per_s", "M", "alpha"))
            for h in hist)
        if not ok:
            raise SwiftkError(f"search state {self.state_path} is damaged (its history entries are not "
                              f"{{x, tokens_per_s, M, alpha}}); delete it to start the search afresh")
        self.history = list(hist)

    def _save_state(self) -> None:
        if self.state_path is not None:
            write_json_atomic(self.state_path, {"version": STATE_VERSION, "model": self.eng.identity.get("name"),
                                           "n_coords": len(self.coords), "history": self.history})

    def mask(self, x) -> torch.Tensor:
        s = torch.zeros(2 * self.eng.config.n_layers, dtype=torch.bool)
        for c, v in zip(self.coords, x):
            s[c] = bool(v > 0.5)
        return s

    def evaluate(self, x) -> dict:
        """Tokens/s (and M, alpha) of static self-speculative greedy decoding with mask(x) on every prompt."""
        skip = self.mask(x)
        toks, wall, acc_len, rounds, drafted, accepted = 0, 0.0, 0, 0, 0, 0
        for ids in self.ids:
            t = time.perf_counter()
            r = self.eng.generate(ids, max_new_tokens=self.max_new, method="static", skip_set=skip)
            wall += time.perf_counter() - t
            s = r.stats
            toks += s["new_tokens"]
            acc_len += s["accepted_tokens"] + s["rounds"]   # tokens emitted by verify passes
            rounds += s["rounds"]
            drafted += s["drafted_tokens"]
            accepted += s["accepted_tokens"]
        return {"x": [float(v) for v in x], "tokens_per_s": toks / wall if wall else 0.0,
                "M": acc_len / rounds if rounds else 0.0, "alpha": accepted / drafted if drafted else 0.0}

    def _suggest(self, rng) -> np.ndarray:
        if len(self.history) < self.n_init:
            return rng.random(len(self.coords))
        # lazy: heavy (bayes_opt, sklearn), only past the random start
        from bayes_opt import BayesianOptimization, acquisition

        keys = [f"x{i:03d}" for i in range(len(self.coords))]
        bo = BayesianOptimization(f=None, pbounds={k: (0.0, 1.0) for k in keys},
                                  acquisition_function=acquisition.UpperConfidenceBound(kappa=self.kappa),
                                  random_state=int(rng.integers(2**31)), verbose=0, allow_duplicate_points=True)
        bo.set_gp_params(alpha=1e-2)
        for h in self.history:
            bo.register(params=dict(zip(keys, h["x"])), target=h["tokens_per_s"])
        s = bo.suggest()
        return np.array([s[k] for k in keys])

    def run(self, progress: bool = True) -> dict:
        """Evaluate until ``iterations`` points are in the history; returns the best entry."""
        from tqdm import tqdm   # lazy: only for the search's progress bar

        rng = np.random.default_rng(self.seed + len(self.history))
        self.eng.generate(self.ids[0], max_new_tokens=4, method="autoregressive")  # warm-up, budget measurement
        self.eng.costs.budget()
        bar = tqdm(total=self.iterations, initial=min(len(self.history), self.iterations), unit="set",
                   disable=not progress, desc="skip-set search")
        while len(self.history) < self.iterations:
            rec = self.evaluate(self._suggest(rng))
            self.history.append(rec)
            self._save_state()
            bar.update(1)
            bar.set_postfix(tok_s=f"{rec['tokens_per_s']:.1f}", best=f"{self.best()['tokens_per_s']:.1f}")
        bar.close()
        return self.best()

    def best(self) -> dict:
        return max(self.history, key=lambda h: h["tokens_per_s"])

    def write(self, out_path, best: Optional[dict] = None) -> Path:
        """The best set as a skip-set file (LearnedStates.save_skip_set format + the search's numbers)."""
        best = best or self.best()
        self.eng.states.save_skip_set(out_path, self.mask(best["x"]), source="self-sd offline search",
                               objective={"tokens_per_s": best["tokens_per_s"], "M": best["M"], "alpha": best["alpha"],
                                          "iterations": len(self.history), "prompts": len(self.ids),
                                          "max_new_tokens": self.max_new})
        return Path(out_path)
