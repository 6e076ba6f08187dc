"""A smaller model of the same family as the drafter (``swiftk.load(target, draft_model=NAME)``): classic
speculative decoding, with the draft's chain merged into the round's tree beside the free sources' chains.

The draft model keeps its own KV cache and the list of tokens whose KV it holds (``seq``). Each round it takes
the longest common start of ``seq`` and the committed sequence, computes the rest in one pass (usually just the
pending root: the spine it drafted last round was mostly accepted), then drafts one token per step while the gate
expects the next to pay. What it drafted past the committed tokens is simply not matched next round, so a
rejected draft needs no rollback. Its cache is its own: reusing it across calls is safe whatever the arithmetic,
because the target verifies every token.
"""
from __future__ import annotations

import time

import torch

from ..errors import SwiftkError
from ..home import swiftk_home
from .draft_head import DraftHead, frequent_token_ids
from .draft_loop import ModelDrafter, draft_chain
from ..runtime.model import Model
from ..target import Target


# Tokens a catch-up pass reads at most: a longer one (a new prompt, or a long stretch of rounds left to the free
# sources) starts the draft again on the last WINDOW tokens. The whole prompt cost code chat 5-10% of its wall time (a
# 0.5B pass over 150-400 tokens, 0.1-0.2 s).
WINDOW = 64


def load_draft_model(target: Target, ckpt, weights, activations, draft_vocab: int) -> "DraftModel":
    """The draft model of ``target`` from a loaded checkpoint, with the target's weight options: its vocabulary
    must be the target's, token for token. ``draft_vocab``: its reduced head's frequent tokens (0: the full head)."""
    if not hasattr(ckpt, "tokenizer") or not hasattr(ckpt, "config"):
        raise SwiftkError(f"Engine(draft_model=...) takes a loaded checkpoint, got {type(ckpt).__name__}; "
                          "swiftk.load(..., draft_model=NAME_OR_PATH) loads one")
    name = ckpt.identity.get("name") or "model"
    if ckpt.tokenizer.ids_fingerprint() != target.tokenizer.ids_fingerprint():   # its eos may differ (base vs chat)
        raise SwiftkError(f"draft_model {name!r} does not share the target's tokenizer (other tokens or merges): "
                          "a draft must propose the target's token ids")
    if ckpt.config.vocab_size != target.config.vocab_size:
        raise SwiftkError(f"draft_model {name!r} scores {ckpt.config.vocab_size} token ids, the target "
                          f"{target.config.vocab_size}: its logits must cover the target's vocabulary row for row")
    if ckpt.config.max_position < target.max_context:
        raise SwiftkError(f"draft_model's context length {ckpt.config.max_position} is shorter than "
                          f"max_context {target.max_context}")
    model = Model(ckpt.config, ckpt.tensors, device=target.device, dtype=target.dtype, weights=weights,
                  activations=activations, kv_cache=str(target.model.kv_dtype).replace("torch.", ""))
    ckpt.tensors = {}
    info = {"model": dict(ckpt.identity), "weights": model.weights, "weight_bytes": model.weight_bytes(),
            "weight_ratio": round(model.weight_bytes() / max(1, target.model.weight_bytes()), 4),
            "draft_vocab": draft_vocab}
    head = draft_model_head(model, target.tokenizer, draft_vocab, target.max_context, target.identity.get("name"))
    return DraftModel(model, target.kv_slots, info, head=head)


def draft_model_head(model, tokenizer, size: int, max_context: int, name) -> "DraftHead | None":
    """The draft model's reduced-vocabulary head (the target's ``draft_vocab`` option: ``size`` frequent tokens
    plus each call's context), or None for its full head: Qwen2.5-0.5B's 151936 x 896 head is ~28% of its
    weight bytes, read every draft step."""
    if not 0 < size < model.cfg.vocab_size // 2:
        return None
    base = frequent_token_ids(tokenizer, size, cache_dir=swiftk_home() / "draft_vocab", model_name=str(name or "model"))
    return DraftHead(model.lm_head, base.to(model.device), len(base) + max_context + 64)


class DraftModel:
    """The draft model and its KV cache (one owner: the engine's "draft_model" resource)."""

    def __init__(self, model, max_slots: int, info: dict, window: int = WINDOW, head=None):
        """``head``: a draft_head.DraftHead on the draft model's LM head (its frequent tokens, then each call's
        context), or None for the full head."""
        self.model, self.info, self.window = model, info, window
        self.head, self.n_base = head, len(head) if head is not None else 0
        self.cache = model.new_cache(max_slots)
        self.base = 0             # the sequence's index of the token in slot 0
        self.seq: list = []       # tokens whose KV is in cache slots [0, len(seq)): cache.length == len(seq)
        self.step_s = None        # seconds of a one-token draft step (an EMA kept for the engine's lifetime)

    def forget(self) -> None:
        """Hold nothing from earlier calls (a call that must not reuse another's context: no timing to leak)."""
        self.base, self.seq = 0, []
        self.cache.truncate(0)

    @torch.inference_mode()
    def first(self, tokens: list, head=None) -> torch.Tensor:
        """Catch up with ``tokens`` (the committed sequence and the pending root): logits [V] for what follows.
        Nothing shared, or a catch-up longer than ``window`` tokens, restarts the draft on the last ``window`` only:
        positions are relative to ``base``, which rotary embeddings do not see."""
        if len(tokens) > self.cache.max_slots:
            raise SwiftkError(f"the draft model's cache holds {self.cache.max_slots} tokens, not {len(tokens)}")
        c, n = 0, min(len(self.seq), len(tokens) - 1 - self.base)   # at least the root is computed: its row
        while c < n and self.seq[c] == tokens[self.base + c]:       # gives the logits
            c += 1
        if c == 0 or self.base > len(tokens) - 1 or self.window and len(tokens) - self.base - c > self.window:
            self.base, c = max(0, len(tokens) - self.window) if self.window else 0, 0
        self.cache.truncate(c)
        del self.seq[c:]
        dev, T = self.model.device, len(tokens) - self.base - c
        pos = torch.arange(c, c + T, device=dev)
        logits = self.model.forward(torch.tensor(tokens[self.base + c:], device=dev), pos, pos, self.cache,
                                    logits_idx=torch.tensor([T - 1], device=dev), head=head)
        self.cache.advance(T)
        self.seq += tokens[self.base + c:]
        return logits[0]

    @torch.inference_mode()
    def next(self, token: int, head=None) -> torch.Tensor:
        """One draft step: ``token`` after ``seq`` -> logits [V] for what follows it."""
        n = self.cache.length
        if n + 1 > self.cache.max_slots:
            raise SwiftkError(f"the draft model's cache holds {self.cache.max_slots} tokens")
        t = time.perf_counter()
        pos = torch.tensor([n], device=self.model.device)
        logits = self.model.forward(torch.tensor([token], device=self.model.device), pos, pos, self.cache, start=n,
                                    head=head)
        self.cache.advance(1)
        self.seq.append(token)
        if self.model.device.type == "cuda":   # launches return before the pass has run
            torch.cuda.synchronize(self.model.device)
        dt = time.perf_counter() - t   # an EMA as the cost model's, one hiccup capped at 3x
        self.step_s = dt if self.step_s is None else self.step_s + 0.2 * (min(dt, 3 * self.step_s) - self.step_s)
        return logits[0]


class DraftModelDraft(ModelDrafter):
    """The draft model behind the model-drafter protocol the round uses."""

    def __init__(self, runner: DraftModel, state, costs):
        if runner.head is not None:
            runner.head.truncate(runner.n_base)   # the last call's context tokens out
        super().__init__(state, runner.head)
        self.runner, self.costs = runner, costs

    def step_cost(self) -> float:
        """Seconds of one draft step (prior before one is timed: the draft's share of the target's weight bytes)."""
        r = self.runner
        if r.step_s is not None:
            return r.step_s
        return (self.costs.step or 1.0) * r.info.get("weight_ratio", 0.5)

    def observe_cost(self, seconds_per_step: float) -> None:
        """The runner times its own one-token steps: the round's draft time also holds the free sources' and the
        catch-up pass (a whole prompt in a call's first drafting round)."""

    def propose(self, dc) -> list:
        # a model draft costs ~0.3 of a plain step a token: beside free chains that are expected to do better
        # alone the round is left to them
        if not dc.gate.model_draft_pays(dc.chains) or not dc.gate.should_draft():   # the estimate first: each
            return []   # round's is made fresh, for the free-only round that may follow
        r, head = self.runner, self._head(dc.tokens)
        f = None if head is None else head.logits_full

        def step(token: int, j: int) -> tuple:
            return (r.first(dc.tokens, f) if j == 0 else r.next(token, f)), None

        return draft_chain(step, dc.cache.length, dc.tokens[-1], dc.sampler, dc.gate, self.calibrate,
                           self.step_cost(), max_draft=dc.max_draft, max_spine=dc.max_spine, topk_bins=dc.bins,
                           rejection=dc.rejection)
