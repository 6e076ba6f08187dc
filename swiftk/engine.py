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


def write_json_atomic(path: Union[str, os.PathLike], data) -> None:
    """JSON to a temp file next to ``path``, then rename: readers never see half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these files are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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

    def save_skip_set(self, path: Union[str, os.PathLike], skip_set: Optional[torch.Tensor] = None, **extra) -> None:
        """Write ``skip_set`` (default: the current one) as JSON tagged with the model identity; ``extra`` fields
        (e.g. a search's objective) are stored alongside."""
        s = self.skip_set if skip_set is None else skip_set
        data = {"model": self.identity, "n_layers": self.config.n_layers,
                "attention": [i // 2 for i in range(0, len(s), 2) if s[i]],
                "mlp": [i // 2 for i in range(1, len(s), 2) if s[i]],
                "matchness": None if self.optimizer is None or skip_set is not None else self.optimizer.best_score,
                **extra}
        write_json_atomic(path, data)

    def read_skip_set(self, path: Union[str, os.PathLike]) -> torch.Tensor:
        """Parse a skip-set JSON file written by save_skip_set / ``swiftk optimize`` for this model."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SwiftkError(f"cannot read skip set file {path}: {e}") from None
        if not isinstance(data, dict):
            raise SwiftkError(f"skip set file {path}: expected a JSON object, got {type(data).__name__}")
        L = self.config.n_layers
        model = data.get("model") if isinstance(data.get("model"), dict) else {}
        if data.get("n_layers") != L or model.get("name") != self.identity.get("name"):
            raise SwiftkError(f"skip set in {path} is for model {model.get('name')!r} with "
                              f"{data.get('n_layers')} layers, not {self.identity.get('name')!r} with {L}")
        return self.skip_set_from_layers(data.get("attention", []), data.get("mlp", []), where=f"skip set in {path}")

    def skip_set_from_layers(self, attention, mlp, where: str = "skip set") -> torch.Tensor:
        """bool [2L] from lists of layer indices whose attention / MLP sublayer the draft skips."""
        L = self.config.n_layers
        s = torch.zeros(2 * L, dtype=torch.bool)
        for key, layers, off in (("attention", attention, 0), ("mlp", mlp, 1)):
            if not isinstance(layers, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                for x in layers):
                raise SwiftkError(f"{where}: {key!r} must be a list of layer indices, got {layers!r}")
            for layer in layers:
                if not 0 < layer < L - 1:
                    raise SwiftkError(f"{where}: layer {layer} cannot be skipped (first/last or out of range 0..{L - 1})")
                s[2 * layer + off] = True
        return s

    def load_skip_set(self, path: Union[str, os.PathLike], optimize: bool = False) -> None:
        """Use a saved skip set; by default stop optimizing (the acceleration phase starts at once)."""
        s = self.read_skip_set(path)
        self.skip_set = s
        if not optimize:
            self.optimizer.finish()
            self.optimizer.best = s

    def early_exit_skip_set(self, exit_layer: int) -> torch.Tensor:
        """The early-exit draft as a skip set: every sublayer from ``exit_layer`` on is skipped."""
        L = self.config.n_layers
        if not isinstance(exit_layer, int) or isinstance(exit_layer, bool) or not 1 <= exit_layer < L:
            raise SwiftkError(f"exit_layer must be an int in [1, {L - 1}] for this {L}-layer model, got {exit_layer!r}")
        s = torch.zeros(2 * L, dtype=torch.bool)
        s[2 * exit_layer:] = True
        return s

    def _fixed_skip(self, method: str, exit_layer, skip_set, optimize_kw) -> Optional[torch.Tensor]:
        """The draft's skip set when it is fixed for this call (early exit, static set), else None (SWIFT state)."""
        if exit_layer is not None and method != "early_exit":
            raise SwiftkError(f"exit_layer is an option of method='early_exit', not {method!r}")
        if method == "early_exit":
            if exit_layer is None:
                raise SwiftkError("method='early_exit' needs exit_layer=E (the draft runs layers 0..E-1)")
            if skip_set is not None:
                raise SwiftkError("method='early_exit' takes exit_layer, not skip_set")
            return self.early_exit_skip_set(exit_layer)
        if skip_set is None:
            if method == "static":
                raise SwiftkError("method='static' needs skip_set=PATH (a file from save_skip_set or swiftk optimize)")
            return None
        if method == "autoregressive":
            raise SwiftkError("skip_set is an option of the speculative methods, not 'autoregressive'")
        if optimize_kw:
            raise SwiftkError("skip_set=... decodes with that set without optimizing; to keep optimizing from it "
                              "use engine.load_skip_set(path, optimize=True)")
        if isinstance(skip_set, torch.Tensor):
            n = 2 * self.config.n_layers
            if skip_set.dtype != torch.bool or tuple(skip_set.shape) != (n,):
                raise SwiftkError(f"skip_set tensor must be bool of shape [{n}], got {skip_set.dtype} {tuple(skip_set.shape)}")
            return skip_set.cpu()
        if isinstance(skip_set, dict):
            return self.skip_set_from_layers(skip_set.get("attention", []), skip_set.get("mlp", []))
        if isinstance(skip_set, (str, os.PathLike)):
            return self.read_skip_set(skip_set)
        raise SwiftkError(f"skip_set must be a file path, a dict of layer lists or a bool tensor, got {type(skip_set).__name__}")

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
                # not "stop at the first miss": one noisy timing must not cut the budget short
                if cost(T) <= 1.6 * c1:
                    budget = T
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
                 progress: bool = False, exit_layer: Optional[int] = None, skip_set=None,
                 **swift_kw) -> GenerationResult:
        """Generate a continuation; greedy when temperature == 0.

        ``method``: "swift" (default: layer-skip draft, skip set optimized on the fly), "autoregressive",
        "early_exit" (draft = layers 0..exit_layer-1, then the LM head) or "static" (draft with ``skip_set``, e.g.
        from ``swiftk optimize``; "swift" with ``skip_set`` does the same). ``skip_set``: a JSON path, a dict
        {"attention": [...], "mlp": [...]} or a bool tensor [2L]. ``callback(text_piece)`` streams text as it is
        produced; SWIFT keyword options (see SwiftConfig) apply to this call only.
        """
        if method not in METHODS:
            raise SwiftkError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
        if isinstance(stop, str):
            stop = [stop]
        sp = SamplingParams(temperature, top_k, top_p, seed).validate()
        if method == "early_exit" and "kvq" not in swift_kw:
            # the exit boundary sits mid-model: reusing the layers below it cut the CPU verify pass to 0.86-0.88x
            # (python -m bench.kvq); layer-skip sets start skipping near layer 1, so there it is off by default
            swift_kw = {**swift_kw, "kvq": True}
        cfg = SwiftConfig.from_kwargs(self.swift_config, swift_kw) if swift_kw else self.swift_config
        fixed = self._fixed_skip(method, exit_layer, skip_set, swift_kw.get("optimize"))
        ids = self.encode_prompt(prompt, chat)
        check_lengths(len(ids), max_new_tokens, self.max_context, self.config.max_position)
        if method != "autoregressive" and not cfg.max_tree_nodes:
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
                stats = swift_decode(self, ids, sp, sink, cfg, skip=fixed)
        finally:
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - t0
        if method == "early_exit":
            stats["exit_layer"] = exit_layer
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
