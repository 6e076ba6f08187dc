"""Engine: owns the model, the KV cache, the tokenizer and the SWIFT optimizer state across prompts."""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from .errors import SwiftkError
from .generate import (METHODS, GenerationResult, SamplingParams, TokenSink, autoregressive, check_lengths, rate)
from .model import Model, TreeMask, resolve_device, resolve_dtype
from .optimizer import SkipSetOptimizer
from .swift import SwiftConfig, swift_decode

# slots reserved past the context for the draft / matchness / verify scratch region
_SCRATCH = 128


class Engine:
    def __init__(self, checkpoint, device="cpu", dtype="float32", max_context: Optional[int] = None, **swift_kw):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.identity = dict(checkpoint.identity)
        self.model = Model(self.config, checkpoint.tensors, device=self.device, dtype=self.dtype)
        checkpoint.tensors = {}  # the model holds its own (fused) copies; free the loader's
        ctx = self.config.max_position
        if max_context is None:
            max_context = min(ctx, 4096)
        if not isinstance(max_context, int) or max_context < 2:
            raise SwiftkError(f"max_context must be an int >= 2, got {max_context!r}")
        if max_context > ctx:
            raise SwiftkError(f"max_context {max_context} exceeds the model's context length {ctx}")
        self.max_context = max_context
        self.cache = self.model.new_cache(max_context + _SCRATCH)
        self.swift_config = SwiftConfig.from_kwargs(SwiftConfig(), swift_kw)
        if self.swift_config.context_window + 1 >= _SCRATCH:
            raise SwiftkError(f"context_window must be < {_SCRATCH - 1}")
        self.optimizer: Optional[SkipSetOptimizer] = None
        self.skip_set: Optional[torch.Tensor] = None
        self.tokens_seen = 0
        self._skip_dev = (None, None)
        self._tree_budget: Optional[int] = None
        self.reset_optimizer()

    # ------------------------------------------------------------------ skip set state
    def reset_optimizer(self, **swift_kw) -> None:
        """Forget what was learned: back to the uniform skip set and a fresh optimizer."""
        if swift_kw:
            self.swift_config = SwiftConfig.from_kwargs(self.swift_config, swift_kw)
        c = self.swift_config
        self.optimizer = SkipSetOptimizer(self.config.n_layers, c.skip_ratio, c.bayes_interval, c.max_opt_steps,
                                          c.patience, c.max_matchness, seed=c.opt_seed, bo_mode=c.bo_mode)
        self.skip_set = self.optimizer.initial()
        self.tokens_seen = 0

    def skip_set_device(self) -> torch.Tensor:
        if self._skip_dev[0] is not self.skip_set:
            self._skip_dev = (self.skip_set, self.skip_set.to(self.device))
        return self._skip_dev[1]

    def save_skip_set(self, path: Union[str, os.PathLike]) -> None:
        s = self.skip_set
        data = {"model": self.identity, "n_layers": self.config.n_layers,
                "attention": [i // 2 for i in range(0, len(s), 2) if s[i]],
                "mlp": [i // 2 for i in range(1, len(s), 2) if s[i]],
                "matchness": None if self.optimizer is None else self.optimizer.best_score}
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent or ".")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load_skip_set(self, path: Union[str, os.PathLike], optimize: bool = False) -> None:
        """Use a saved skip set; by default stop optimizing (the acceleration phase starts at once)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SwiftkError(f"cannot read skip set file {path}: {e}") from None
        L = self.config.n_layers
        if data.get("n_layers") != L or data.get("model", {}).get("name") != self.identity.get("name"):
            raise SwiftkError(f"skip set in {path} is for model {data.get('model', {}).get('name')!r} with "
                              f"{data.get('n_layers')} layers, not {self.identity.get('name')!r} with {L}")
        s = torch.zeros(2 * L, dtype=torch.bool)
        for key, off in (("attention", 0), ("mlp", 1)):
            for layer in data.get(key, []):
                if not 0 < int(layer) < L - 1:
                    raise SwiftkError(f"skip set in {path}: layer {layer} cannot be skipped (first/last or out of range)")
                s[2 * int(layer) + off] = True
        self.skip_set = s
        if not optimize:
            self.optimizer.finish()
            self.optimizer.best = s

    def auto_tree_budget(self) -> int:
        """Largest verify size whose cost stays within 1.6x one decode step (measured once per engine).

        A verify pass of T tokens costs about a single step on a GPU (memory bound) but several on a small CPU,
        so the right tree size is a property of the device, like EAGLE-2's total_token.
        """
        if self._tree_budget is None:
            m, dev = self.model, self.device
            base = 64
            cache = self.cache

            def cost(T):
                toks = torch.zeros(T, dtype=torch.long, device=dev)
                pos = torch.arange(base, base + T, device=dev)
                mask = TreeMask.causal(base, T, dev)
                best = float("inf")
                for _ in range(3):
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    m.forward(toks, pos, pos, cache, attn_mask=mask)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    best = min(best, time.perf_counter() - t0)
                return best

            cost(1)  # warm-up
            c1 = cost(1)
            budget = 4
            for T in (8, 12, 16, 24, 32, 48, 64):
                if cost(T) <= 1.6 * c1:
                    budget = T
                else:
                    break
            self._tree_budget = budget
        return self._tree_budget

    # ------------------------------------------------------------------ generation
    def encode_prompt(self, prompt, chat: bool = False) -> list:
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise SwiftkError(f"token id {bad[0]} is outside the vocabulary (size {self.config.vocab_size})")
            return ids
        if chat:
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if not self.tokenizer.chat_template:
                raise SwiftkError("chat=True but this model has no chat template")
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_bos=False)
        else:
            if not isinstance(prompt, str):
                raise SwiftkError(f"prompt must be a string, a list of token ids or (chat=True) messages, got {type(prompt).__name__}")
            ids = self.tokenizer.encode(prompt)
        if not prompt or not ids:
            raise SwiftkError("prompt is empty")
        return ids

    def generate(self, prompt, max_new_tokens: int = 128, method: str = "swift", temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None, stop: Sequence[str] = (),
                 chat: bool = False, callback: Optional[Callable[[str], None]] = None,
                 progress: bool = False, **swift_kw) -> GenerationResult:
        """Generate a continuation. ``method``: "swift" (default) or "autoregressive"; greedy when temperature == 0.

        ``callback(text_piece)`` streams text as it is produced; SWIFT keyword options (see SwiftConfig) apply to
        this call only.
        """
        if method not in METHODS:
            raise SwiftkError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
        if isinstance(stop, str):
            stop = [stop]
        sp = SamplingParams(temperature, top_k, top_p, seed).validate()
        cfg = SwiftConfig.from_kwargs(self.swift_config, swift_kw) if swift_kw else self.swift_config
        ids = self.encode_prompt(prompt, chat)
        check_lengths(len(ids), max_new_tokens, self.max_context, self.config.max_position)
        if method == "swift" and not cfg.max_tree_nodes:
            # measured before decoding starts: the timing passes write scratch KV into the cache
            cfg = dataclasses.replace(cfg, max_tree_nodes=self.auto_tree_budget())
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=max_new_tokens, unit="tok", leave=False)
        cb = callback
        if bar is not None:
            def cb(piece, _inner=callback):
                bar.n = len(sink.ids)
                bar.refresh()
                if _inner:
                    _inner(piece)
        sink = TokenSink(self.tokenizer, max_new_tokens, stop, cb)
        t0 = time.perf_counter()
        try:
            if method == "autoregressive":
                stats = autoregressive(self, ids, sp, sink)
            else:
                stats = swift_decode(self, ids, sp, sink, cfg)
        finally:
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - t0
        stats = {"method": method, "new_tokens": len(sink.ids), "prompt_tokens": len(ids), "wall_time_s": wall,
                 "tokens_per_s": rate(len(sink.ids), wall), **stats}
        return GenerationResult(text=sink.text, token_ids=list(sink.ids), prompt_ids=ids,
                                finish_reason=sink.finish_reason, stats=stats)

    def stream(self, prompt, **kw) -> Iterator[str]:
        """Iterator over text pieces (runs generation in a worker thread and yields as pieces arrive)."""
        import queue
        import threading

        q: queue.Queue = queue.Queue()
        done = object()
        box = {}

        def run():
            try:
                box["result"] = self.generate(prompt, callback=q.put, **kw)
            except BaseException as e:  # surfaced in the consumer
                box["error"] = e
            finally:
                q.put(done)

        th = threading.Thread(target=run, daemon=True)
        th.start()
        while (item := q.get()) is not done:
            yield item
        th.join()
        if "error" in box:
            raise box["error"]

    @torch.inference_mode()
    def logits(self, token_ids) -> torch.Tensor:
        """Full-model logits [T, vocab] (float32) for a whole sequence, for reference checks."""
        ids = list(token_ids)
        if not ids:
            raise SwiftkError("token_ids is empty")
        if len(ids) > self.max_context:
            raise SwiftkError(f"{len(ids)} tokens exceed the context ({self.max_context})")
        dev = self.device
        self.cache.reset()
        T = len(ids)
        return self.model.forward(torch.tensor(ids, device=dev), torch.arange(T, device=dev),
                                  torch.arange(T, device=dev), self.cache)

    def info(self) -> dict:
        from .ops import describe

        c = self.config
        return {"model": self.identity, "config": c.to_dict(), "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "parameters": self.model.n_params(),
                "weight_bytes": self.model.weight_bytes(), "max_context": self.max_context,
                "kv_cache_bytes": self.cache.data.numel() * self.cache.data.element_size(),
                "backends": describe(self.device)}
