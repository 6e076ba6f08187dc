"""The target's choice of the next token: sampling settings (validated) and the sampler every method verifies
against (greedy, coupled Gumbel-max, or rejection sampling)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import SwiftkError
from ..runtime.ops.cpu_topk import topk_rows
from .logits import process_logits, validate_sampling_params

MAX_SEED = 2**63 - 1


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def validate(self) -> "SamplingParams":
        validate_sampling_params(self.temperature, self.top_k, self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise SwiftkError(f"seed must be None or an int in [0, 2**63-1], got {self.seed!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return process_logits(logits, self.temperature, self.top_k, self.top_p)


class Sampler:
    """The target's choice of the next token, as a score whose argmax is that choice.

    Greedy: the logits. Sampling (coupled, the default): Gumbel-max with noise keyed by (seed, position), i.e. the
    token at absolute position t is ``argmax_x log p_t(x) + G_t(x)`` with G_t i.i.d. Gumbel drawn from a generator
    seeded by (seed, t). That is an exact draw from p_t (the processed target distribution), and it is a
    deterministic function of the seed, the position and the context: any draft verified against it emits exactly
    the tokens autoregressive decoding with the same seed emits. Seeded sampling is therefore reproducible across
    methods, skip sets and engine states. ``rejection`` keeps SpecInfer-style tree rejection sampling
    (rejection.accept_sampling) for the speculative rounds; its output depends on the draft.
    """

    def __init__(self, sp: SamplingParams, device, rule: str = "coupled"):
        self.sp, self.device, self.rule = sp, torch.device(device), rule
        self.seed = sp.seed if sp.seed is not None else random.SystemRandom().randrange(MAX_SEED)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)
        self._noise: dict = {}

    @property
    def greedy(self) -> bool:
        return self.sp.greedy

    def noise(self, position: int, V: int) -> torch.Tensor:
        g = self._noise.get(position)
        if g is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed((self.seed * 0x9E3779B97F4A7C15 + position) % MAX_SEED)
            u = torch.rand(V, generator=gen, device=self.device).clamp_(1e-20, 1.0 - 1e-7)
            g = self._noise[position] = -torch.log(-torch.log(u))
        return g

    def release(self, below: int) -> None:
        """Forget the noise of positions already committed."""
        for p in [p for p in self._noise if p < below]:
            del self._noise[p]

    def coupled(self, logp: torch.Tensor, position: int) -> torch.Tensor:
        """The coupled rule's score of one row: log-probabilities [V] plus the Gumbel noise keyed by (seed,
        position); its argmax is the token drawn at that position. The target's rows (``scores``) and a draft's
        candidates (proposers/draft_loop.py) both rank by it, so a draft proposes what the target will choose."""
        return logp + self.noise(position, logp.shape[-1])

    def scores(self, logits: torch.Tensor, positions) -> torch.Tensor:
        """[N, V] logits of the rows predicting ``positions`` -> scores whose row argmax is the choice."""
        if self.greedy:
            return logits
        logp = torch.log(self.sp.probs(logits))
        return torch.stack([self.coupled(row, int(p)) for row, p in zip(logp, positions)])

    def pick(self, logits_row: torch.Tensor, position: int) -> int:
        return int(topk_rows(self.scores(logits_row[None], [position]), 1)[0, 0])   # torch.argmax's choice
