"""Context-based skip-set search (SWIFT section 4.1), ranked by expected speed.

Every optimization step the decode loop measures one candidate's *matchness* (teacher-forced draft agreement on
the last ``context_window`` generated tokens, drafter.matchness) and reports it with a *score*:
- ``objective="speed"`` (default): the expected tokens per decode-step time of drafting with that set, from its
  matchness and its measured draft cost (target.costs.CostModel.expected_rate). The number of skipped sublayers varies
  (1 .. skip_ratio of them): cheap sets that still agree win, as in a knapsack over sublayer costs.
- ``objective="matchness"``: the paper's rule, matchness at exactly ``round(skip_ratio * 2L)`` skipped sublayers.

Winner's curse: a set that scored well on one easy window is not better. A candidate that beats the incumbent
becomes a *challenger* and is scored again, together with the incumbent, on the next ``rescore - 1`` windows; it
replaces the incumbent only if its mean over those windows (not the one it was found on) is higher.

Candidates come from random search and, every ``bayes_interval`` steps, from Bayesian optimization (a
``bayesian-optimization`` UCB acquisition, kappa 2.5, over a scikit-learn GP, Matern 2.5, alpha 1e-2). The GP is
fitted in a daemon thread on at most the last 200 points and its acquisition is maximised over sampled points
only (no L-BFGS restarts), so a suggestion takes milliseconds, never re-imports the caller's ``__main__`` (no
subprocess), and decoding goes on with random candidates until it is ready. A failed suggestion is recorded in
``bo_errors`` and random search continues.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np
import torch

from ...background import Background
from ...options import OptimizerConfig
from ...errors import SwiftkError
from ...runtime.skipset import eligible

_GP_POINTS = 200      # the GP sees the newest points only: bounded fit time and memory
_HISTORY = 512        # bounded history (long-running engines)


def bo_suggest(X: np.ndarray, y: np.ndarray, kappa: float, alpha: float, seed: int) -> np.ndarray:
    """One UCB suggestion in [0, 1]^d from a GP fitted to (X, y), maximised over 2048 sampled points."""
    # lazy: heavy (bayes_opt, sklearn), only once the online search fits its GP
    from bayes_opt import acquisition
    from bayes_opt.target_space import TargetSpace
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import Matern
    from threadpoolctl import threadpool_limits

    # a set scored on several windows enters the GP once, with its mean score
    X, inv = np.unique(X, axis=0, return_inverse=True)
    y = np.bincount(inv.ravel(), weights=y) / np.bincount(inv.ravel())
    d = X.shape[1]
    space = TargetSpace(None, {f"x{i:03d}": (0.0, 1.0) for i in range(d)}, random_state=seed,
                        allow_duplicate_points=True)
    for xi, yi in zip(X, y):
        space.register(xi, float(yi))
    gp = GaussianProcessRegressor(kernel=Matern(nu=2.5), alpha=alpha, normalize_y=True, n_restarts_optimizer=0,
                                  random_state=seed)
    with threadpool_limits(1):  # one BLAS thread: the decode loop keeps the other cores
        return np.asarray(acquisition.UpperConfidenceBound(kappa=kappa).suggest(
            gp, space, n_random=2048, n_smart=0, random_state=seed), dtype=np.float64)


PAYS = 1.05   # objective=speed: a set pays when expected this much faster than plain decoding (the cost
#              model's error: near-full sets hover at 0.98-1.02 and never pay)


class SkipSetOptimizer:
    def __init__(self, n_layers: int, cfg: OptimizerConfig, kappa: float = 2.5, gp_alpha: float = 1e-2):
        if n_layers < 3:
            raise SwiftkError(f"layer skipping needs at least 3 layers, the model has {n_layers}")
        self.cfg = cfg
        self.n = 2 * n_layers
        self.eligible = np.array(eligible(n_layers))
        self.skip_count = int(min(max(1, round(cfg.skip_ratio * self.n)), len(self.eligible)))
        self.kappa, self.gp_alpha = kappa, gp_alpha
        self.rng = np.random.default_rng(cfg.opt_seed)
        self.X: list = []             # scored candidates, 0/1 over eligible sublayers (newest _HISTORY)
        self.y: list = []             # their scores
        self.steps = 0
        self.since_improve = 0
        self.best = self.initial()    # the incumbent: the skip set the draft uses
        self.best_score = -1.0        # mean score of the incumbent over the windows it was compared on
        self.best_matchness: Optional[float] = None
        self.challenger: Optional[dict] = None  # {"set", "scores", "inc_scores", "matchness"}
        self.done = cfg.max_opt_steps == 0
        self.history: list = []       # (step, matchness, source), newest _HISTORY
        self.bo_suggestions = 0
        self.bo_errors: list = []
        self.longest_stall_s = 0.0    # longest time propose() blocked the decode loop
        self._job: Optional[threading.Thread] = None
        self._box: dict = {}
        self._ready: Optional[np.ndarray] = None

    # ---- skip-set encodings
    def initial(self) -> torch.Tensor:
        """Uniform start: both sublayers of every other layer (1, 3, 5, ...), trimmed to ``skip_count``."""
        m = np.zeros(self.n, dtype=bool)
        m[[i for i in self.eligible if (i // 2) % 2 == 1][: self.skip_count]] = True
        return torch.from_numpy(m)

    def _from_point(self, x: np.ndarray) -> torch.Tensor:
        """A point in [0, 1]^d -> skip set: the top ``skip_count`` coordinates (matchness objective), or every
        coordinate > 0.5 up to ``skip_count`` of them (speed objective: the count varies)."""
        order = np.argsort(-x, kind="stable")
        k = self.skip_count if self.cfg.objective == "matchness" else min(self.skip_count, int((x > 0.5).sum()))
        m = np.zeros(self.n, dtype=bool)
        m[self.eligible[order[: max(1, k)]]] = True
        return torch.from_numpy(m)

    def _random(self) -> torch.Tensor:
        x = self.rng.random(len(self.eligible))
        if self.cfg.objective == "speed":  # a random count in [1, skip_count]: small sets are cheap to verify
            k = int(self.rng.integers(1, self.skip_count + 1))
            x = np.where(np.argsort(np.argsort(-x)) < k, 0.5 + x / 2, x / 2)
        return self._from_point(x)

    # ---- the loop's interface
    def propose(self) -> tuple:
        """(candidate, source): the pending challenger ('rescore'), a BO suggestion ('bo') or 'random'."""
        t0 = time.perf_counter()
        try:
            if self.challenger is not None:
                return self.challenger["set"], "rescore"
            self._collect()
            if self._ready is None and self.cfg.bayes_interval and self.steps > 0 \
                    and self.steps % self.cfg.bayes_interval == 0 and self._job is None and len(self.y) >= 4:
                self._start_job()
            self._collect()
            if self._ready is not None:
                cand, self._ready = self._from_point(self._ready), None
                self.bo_suggestions += 1
                return cand, "bo"
            return self._random(), "random"
        finally:
            self.longest_stall_s = max(self.longest_stall_s, time.perf_counter() - t0)

    def report(self, cand: torch.Tensor, matchness: float, score: float, source: str = "random",
               incumbent_score: Optional[float] = None) -> bool:
        """Register a scored candidate (``incumbent_score``: the incumbent on the same window, when the loop
        measured it for a re-score). Returns True when the incumbent changed."""
        self.steps += 1
        self._remember(cand, score, (self.steps, float(matchness), source))
        changed = False
        ch = self.challenger
        if ch is not None and source == "rescore":
            ch["scores"].append(score)
            if incumbent_score is not None:
                ch["inc_scores"].append(incumbent_score)
            if len(ch["scores"]) >= self.cfg.rescore:
                # paired: both sets on the same later windows only. The discovery window is left out: the
                # challenger was picked *because* it scored high there, and the incumbent was never measured on it
                # (counting it let one easy window followed by hard ones crown a poor set)
                mine = float(np.mean(ch["scores"][1:]))
                theirs = float(np.mean(ch["inc_scores"])) if ch["inc_scores"] else self.best_score
                if mine > theirs:
                    self.best, self.best_score, self.best_matchness = ch["set"].clone(), mine, ch["matchness"]
                    changed, self.since_improve = True, 0
                else:
                    self.best_score = theirs  # the incumbent's estimate now rests on more windows
                    self.since_improve += 1
                self.challenger = None
        elif score > self.best_score:
            if self.cfg.rescore <= 1 or self.best_score < 0:
                self.best, self.best_score, self.best_matchness = cand.clone(), float(score), float(matchness)
                changed, self.since_improve = True, 0
            else:
                self.challenger = {"set": cand.clone(), "scores": [score], "inc_scores": [],
                                   "matchness": float(matchness)}
        else:
            self.since_improve += 1
        c = self.cfg
        if self.steps >= c.max_opt_steps or self.since_improve >= c.patience or self.challenger is None and (
                self._agrees_fully() or c.objective == "speed" and self.steps >= c.give_up and self.best_score < PAYS):
            self.finish()
        return changed

    def _agrees_fully(self) -> bool:
        """The incumbent agrees past ``max_matchness`` and no set can beat it. Under the speed objective only a set
        of the most sublayers allowed: one that skips a sublayer or two agrees almost surely but costs nearly a
        step per draft token, and a cheaper set may agree as well (such a set ended searches on CPU blocks after
        7 steps: 2 of Qwen2.5-0.5B's 48 sublayers, 0.98 of a step per draft token, never drafted with)."""
        full = self.cfg.objective == "matchness" or int(self.best.sum()) >= self.skip_count
        return full and (self.best_matchness or 0.0) > self.cfg.max_matchness

    def wants_incumbent_score(self) -> bool:
        return self.challenger is not None

    def finish(self) -> None:
        self.done = True
        self.challenger = None

    def _remember(self, cand, score, entry) -> None:
        self.X.append(cand.numpy()[self.eligible].astype(np.float64))
        self.y.append(float(score))
        self.history.append(entry)
        for lst in (self.X, self.y, self.history):
            del lst[:-_HISTORY]

    # ---- background BO (a daemon thread: nothing to re-import; joined at exit, swiftk/background.py)
    def _start_job(self) -> None:
        X, y = np.array(self.X[-_GP_POINTS:]), np.array(self.y[-_GP_POINTS:])
        seed = int(self.rng.integers(2**31))
        if self.cfg.bo_mode == "sync":
            self._run_job(X, y, seed)
            return
        self._job = Background(lambda: self._run_job(X, y, seed), name="swiftk-bo")

    def _run_job(self, X, y, seed) -> None:
        try:
            self._box["x"] = bo_suggest(X, y, self.kappa, self.gp_alpha, seed)
        except Exception as e:  # a failed suggestion must not stop decoding; random search continues
            self._box["error"] = f"{type(e).__name__}: {e}"

    def _collect(self) -> None:
        if self._job is not None and self._job.is_alive():
            return
        self._job = None
        if "error" in self._box:
            self.bo_errors.append(self._box.pop("error"))
            del self.bo_errors[:-8]
        if "x" in self._box:
            self._ready = self._box.pop("x")

    # ---- persistence (state.py)
    def to_dict(self) -> dict:
        return {"best": self.best.nonzero().flatten().tolist(), "best_score": self.best_score,
                "best_matchness": self.best_matchness, "steps": self.steps, "since_improve": self.since_improve,
                "done": self.done, "X": [x.astype(np.uint8).tolist() for x in self.X[-_GP_POINTS:]],
                "y": self.y[-_GP_POINTS:], "bo_suggestions": self.bo_suggestions}

    def load_dict(self, d: dict) -> None:
        best = torch.zeros(self.n, dtype=torch.bool)
        idx = [int(i) for i in d["best"]]
        if any(i not in set(self.eligible.tolist()) for i in idx):
            raise ValueError("skip set outside the eligible sublayers")
        best[idx] = True
        X = [np.asarray(x, dtype=np.float64) for x in d["X"]]
        if any(x.shape != (len(self.eligible),) for x in X) or len(X) != len(d["y"]):
            raise ValueError("history does not match this model")
        self.best, self.best_score = best, float(d["best_score"])
        self.best_matchness = None if d.get("best_matchness") is None else float(d["best_matchness"])
        self.steps, self.since_improve, self.done = int(d["steps"]), int(d["since_improve"]), bool(d["done"])
        self.X, self.y = X, [float(v) for v in d["y"]]
        self.bo_suggestions = int(d.get("bo_suggestions", 0))
