"""Context-based skip-set optimization (SWIFT paper, section 4.1).

Candidates are scored by matchness (computed by the caller). Every step proposes one candidate: a random skip set,
or, when one is ready, a Bayesian-optimization suggestion. The BO suggestion (Gaussian process, Matern 2.5,
alpha 1e-2, UCB kappa 2.5, via the ``bayesian-optimization`` package) is computed off the decode loop in a worker
process, because a GP fit over hundreds of points takes seconds on a small CPU; decoding goes on with the best
set found so far meanwhile.

A skip set is a bool vector over the ``2 * n_layers`` sublayers (attention, MLP per layer); the sublayers of the
first and last layer are never skipped. Exactly ``skip_count = round(skip_ratio * 2 * n_layers)`` are skipped.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
from typing import Optional

import numpy as np
import torch

from .errors import SwiftkError


def _bo_suggest(X: np.ndarray, y: np.ndarray, kappa: float, alpha: float, seed: int) -> np.ndarray:
    """One UCB suggestion from a GP fitted to (X, y). Runs in the worker process."""
    from bayes_opt import BayesianOptimization, acquisition
    from threadpoolctl import threadpool_limits

    keys = [f"x{i:03d}" for i in range(X.shape[1])]
    # One BLAS thread: on a small CPU the decode loop keeps the other cores; oversubscription stalls both.
    with threadpool_limits(1):
        bo = BayesianOptimization(f=None, pbounds={k: (0.0, 1.0) for k in keys},
                                  acquisition_function=acquisition.UpperConfidenceBound(kappa=kappa),
                                  random_state=seed, verbose=0, allow_duplicate_points=True)
        bo.set_gp_params(alpha=alpha)
        # a skip set scored several times (on different windows) enters the GP once, with its mean score
        uniq, inv = np.unique(X, axis=0, return_inverse=True)
        means = np.bincount(inv.ravel(), weights=y) / np.bincount(inv.ravel())
        for xi, yi in zip(uniq, means):
            bo.register(params=dict(zip(keys, xi.tolist())), target=float(yi))
        s = bo.suggest()
    return np.array([s[k] for k in keys])


class SkipSetOptimizer:
    def __init__(self, n_layers: int, skip_ratio: float = 0.45, bayes_interval: int = 25, max_opt_steps: int = 1000,
                 patience: int = 300, max_matchness: float = 0.95, seed: int = 0, bo_mode: str = "process",
                 kappa: float = 2.5, gp_alpha: float = 1e-2):
        if not 0.0 < skip_ratio < 1.0:
            raise SwiftkError(f"skip_ratio must be in (0, 1), got {skip_ratio!r}")
        if bayes_interval < 0:
            raise SwiftkError(f"bayes_interval must be >= 0 (0 disables BO), got {bayes_interval!r}")
        if max_opt_steps < 0 or patience < 1:
            raise SwiftkError(f"max_opt_steps must be >= 0 and patience >= 1, got {max_opt_steps}, {patience}")
        if not 0.0 < max_matchness <= 1.0:
            raise SwiftkError(f"max_matchness must be in (0, 1], got {max_matchness!r}")
        if bo_mode not in ("process", "thread", "sync"):
            raise SwiftkError(f"bo_mode must be 'process', 'thread' or 'sync', got {bo_mode!r}")
        if n_layers < 3:
            raise SwiftkError(f"layer skipping needs at least 3 layers, the model has {n_layers}")
        self.n = 2 * n_layers
        self.eligible = np.arange(2, self.n - 2)
        self.skip_count = int(min(max(1, round(skip_ratio * self.n)), len(self.eligible)))
        self.bayes_interval, self.max_steps, self.patience = bayes_interval, max_opt_steps, patience
        self.max_matchness, self.kappa, self.gp_alpha, self.seed = max_matchness, kappa, gp_alpha, seed
        self.bo_mode = bo_mode
        self.rng = np.random.default_rng(seed)
        self.X: list = []            # observed candidates as 0/1 over eligible sublayers
        self.y: list = []
        self.steps = 0
        self.since_improve = 0
        self.best = self.initial()
        self.best_score = -1.0
        self.done = max_opt_steps == 0
        self.history: list = []      # (step, matchness, source)
        self.bo_suggestions = 0
        self._pool: Optional[cf.Executor] = None
        self._job: Optional[cf.Future] = None
        self._ready: Optional[np.ndarray] = None

    # ---- skip-set encodings
    def initial(self) -> torch.Tensor:
        """Uniform start: both sublayers of every other layer (1, 3, 5, ...), trimmed to ``skip_count``."""
        m = np.zeros(self.n, dtype=bool)
        picks = [i for i in self.eligible if (i // 2) % 2 == 1][: self.skip_count]
        m[picks] = True
        return torch.from_numpy(m)

    def _from_scores(self, scores: np.ndarray) -> torch.Tensor:
        m = np.zeros(self.n, dtype=bool)
        m[self.eligible[np.argsort(-scores, kind="stable")[: self.skip_count]]] = True
        return torch.from_numpy(m)

    def _random(self) -> torch.Tensor:
        return self._from_scores(self.rng.random(len(self.eligible)))

    # ---- the loop's interface
    def propose(self) -> tuple:
        """Next candidate and its source ('bo' or 'random'). Never blocks on the GP except in 'sync' mode."""
        self._collect()
        if self._ready is not None:
            cand, self._ready = self._from_scores(self._ready), None
            self.bo_suggestions += 1
            return cand, "bo"
        if self.bayes_interval and self.steps > 0 and self.steps % self.bayes_interval == 0 and self._job is None:
            self._start_job()
            self._collect()
            if self._ready is not None:  # sync mode: use it now
                cand, self._ready = self._from_scores(self._ready), None
                self.bo_suggestions += 1
                return cand, "bo"
        return self._random(), "random"

    def report(self, cand: torch.Tensor, matchness: float, source: str = "random") -> bool:
        """Register a scored candidate; returns True when it became the best set."""
        self.steps += 1
        self.X.append(cand.numpy()[self.eligible].astype(np.float64))
        self.y.append(float(matchness))
        self.history.append((self.steps, float(matchness), source))
        improved = matchness > self.best_score
        if improved:
            self.best, self.best_score, self.since_improve = cand.clone(), float(matchness), 0
        else:
            self.since_improve += 1
        if self.steps >= self.max_steps or self.since_improve >= self.patience or self.best_score > self.max_matchness:
            self.finish()
        return improved

    def score_initial(self, matchness: float) -> None:
        """Record the starting set's matchness without spending an optimization step on it."""
        if matchness > self.best_score:
            self.best_score = float(matchness)

    def finish(self) -> None:
        self.done = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool, self._job = None, None

    # ---- background BO
    def _start_job(self) -> None:
        X, y = np.array(self.X), np.array(self.y)
        seed = int(self.rng.integers(2**31))
        if self.bo_mode == "sync":
            self._ready = _bo_suggest(X, y, self.kappa, self.gp_alpha, seed)
            return
        if self._pool is None:
            if self.bo_mode == "process":
                self._pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
            else:
                self._pool = cf.ThreadPoolExecutor(max_workers=1)
        self._job = self._pool.submit(_bo_suggest, X, y, self.kappa, self.gp_alpha, seed)

    def _collect(self) -> None:
        if self._job is not None and self._job.done():
            job, self._job = self._job, None
            try:
                self._ready = job.result()
            except Exception as e:  # a failed suggestion must not stop decoding; random search continues
                self.history.append((self.steps, float("nan"), f"bo-error: {type(e).__name__}: {e}"))

    def __del__(self):
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
