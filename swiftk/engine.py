"""Engine: owns the model, the KV cache, the tokenizer, the cost model and the learned decoding state.

One call of :meth:`Engine.generate` holds the engine's lock (two threads calling it serialize; the KV cache has one
owner at a time), validates every option before any work, and hands the decode loop exactly what it needs:
``swift_decode(model, cache, state, costs, prompt_ids, sampler, sink, decode_config, ...)``.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from . import skipset
from .config import DecodeConfig, OptimizerConfig, option_names, updated
from .costs import CostModel
from .errors import SwiftkError
from .generate import (METHODS, GenerationResult, Sampler, SamplingParams, TokenSink, autoregressive,
                       check_lengths, rate)
from .model import Model, resolve_device, resolve_dtype
from .state import SkipSetState
from .swift import swift_decode

# slots reserved past the context for the draft / matchness / verify scratch region (context_window <= 120,
# trees <= 64 nodes)
_SCRATCH = 128
_DECODE_OPTS = option_names(DecodeConfig)
_OPT_OPTS = option_names(OptimizerConfig)


def split_options(kw: dict) -> tuple:
    """(decode options, optimizer options); unknown names raise."""
    unknown = set(kw) - _DECODE_OPTS - _OPT_OPTS
    if unknown:
        raise SwiftkError(f"unknown option(s): {', '.join(sorted(unknown))}; decode options: "
                          f"{', '.join(sorted(_DECODE_OPTS))}; optimizer options: {', '.join(sorted(_OPT_OPTS))}")
    return ({k: v for k, v in kw.items() if k in _DECODE_OPTS}, {k: v for k, v in kw.items() if k in _OPT_OPTS})


class Engine:
    def __init__(self, checkpoint, device="cpu", dtype="float32", max_context: Optional[int] = None,
                 persist: Optional[bool] = None, weights: Optional[str] = None, drafter=None,
                 cuda_graphs: Optional[bool] = None, **options):
        """``options``: decode options (defaults for every call) and optimizer options (the learned state's).
        ``weights``: None, "bfloat16" or "int8": a compressed CPU weight format (see :class:`Model`).
        ``persist`` (default: True for registry/file models): keep the learned state and the cost model in
        ``$SWIFTK_HOME/state`` so the next process starts warm. ``drafter``: path of a trained MoA drafter for
        ``method="moa"`` (default: found by model name, see :meth:`drafter_path`). ``cuda_graphs``: None (on for a
        CUDA device, unless SWIFTK_CUDA_GRAPHS=0), True (CUDA only) or False."""
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.identity = dict(checkpoint.identity)
        decode_kw, opt_kw = split_options(options)
        self.decode_config = updated(DecodeConfig(), decode_kw)
        opt_cfg = updated(OptimizerConfig(), opt_kw)
        ctx = self.config.max_position
        if max_context is None:
            max_context = min(ctx, 4096)
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
            raise SwiftkError(f"max_context must be an int >= 2, got {max_context!r}")
        if max_context > ctx:
            raise SwiftkError(f"max_context {max_context} exceeds the model's context length {ctx}")
        self.model = Model(self.config, checkpoint.tensors, device=self.device, dtype=self.dtype, weights=weights)
        checkpoint.tensors = {}  # the model holds its own (fused) copies; free the loader's
        self.max_context = max_context
        self.cache = self.model.new_cache(max_context + _SCRATCH)
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise SwiftkError(f"cuda_graphs must be True, False or None, got {cuda_graphs!r}")
        if cuda_graphs and self.device.type != "cuda":
            raise SwiftkError(f"cuda_graphs=True needs a CUDA device, got {self.device}")
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and os.environ.get("SWIFTK_CUDA_GRAPHS", "1") != "0"
        if cuda_graphs:
            from .graphs import GraphRunner

            self.model.graphs = GraphRunner(self.model)
        self.costs = CostModel(self.model)
        self._lock = threading.RLock()
        if persist is None:  # SWIFTK_PERSIST=0 turns persistence off by default (tests, benchmarks)
            persist = os.environ.get("SWIFTK_PERSIST", "1") != "0" and bool(self.identity.get("fingerprint"))
        self.persist = bool(persist)
        self.state = SkipSetState(self.config.n_layers, opt_cfg)
        self._draft_head = None        # (size, vocab.DraftHead): the reduced-vocabulary draft head, built once
        self._fixed_states: dict = {}  # fixed drafts (early exit, static sets, n-grams) learn their own statistics
        self._moa = None               # moa.MoARunner, loaded at the first method="moa" call (or now, if given)
        self._datastore = None         # datastore.Datastore, built (or read from $SWIFTK_HOME) at first use
        self._moa_info = None
        if drafter is not None:
            self.load_drafter(drafter)
        if self.persist:
            self._load_persisted(opt_cfg if opt_kw else None)

    # ------------------------------------------------------------------ the learned state
    @property
    def skip_set(self) -> torch.Tensor:
        return self.state.skip_set

    @skip_set.setter
    def skip_set(self, s) -> None:
        self.state.skip_set = skipset.check(s, self.config.n_layers)

    @property
    def optimizer(self):
        return self.state.optimizer

    def new_state(self, **optimizer_options) -> SkipSetState:
        """A fresh learned state (e.g. one per workload in a benchmark): pass it as ``generate(..., state=)``."""
        return SkipSetState(self.config.n_layers, updated(self.state.cfg, optimizer_options))

    def reset_optimizer(self, **optimizer_options) -> None:
        """Forget what was learned: back to the uniform skip set and a fresh optimizer (with these options)."""
        _, opt_kw = split_options(optimizer_options)
        bad = set(optimizer_options) - set(opt_kw)
        if bad:
            raise SwiftkError(f"{', '.join(sorted(bad))}: decode option(s), give them to generate(), not "
                              "reset_optimizer()")
        self.state = self.new_state(**opt_kw)

    def save_skip_set(self, path: Union[str, os.PathLike], skip_set: Optional[torch.Tensor] = None, **extra) -> None:
        s = self.skip_set if skip_set is None else skip_set
        if skip_set is None:
            extra.setdefault("matchness", self.state.optimizer.best_matchness)
        skipset.save(path, s, self.identity, **extra)

    def read_skip_set(self, path: Union[str, os.PathLike]) -> torch.Tensor:
        return skipset.read(path, self.identity, self.config.n_layers)

    def load_skip_set(self, path: Union[str, os.PathLike], optimize: bool = False) -> None:
        """Use a saved skip set; by default stop optimizing (the acceleration phase starts at once)."""
        self.state.use(self.read_skip_set(path), optimize=optimize)

    def skip_set_from_layers(self, attention, mlp) -> torch.Tensor:
        return skipset.from_layers(self.config.n_layers, attention, mlp)

    def early_exit_skip_set(self, exit_layer: int) -> torch.Tensor:
        return skipset.early_exit(self.config.n_layers, exit_layer)

    def auto_tree_budget(self) -> int:
        """Verify budget of speculate='always' with max_tree_nodes=0 (from the cost model)."""
        return self.costs.budget()

    def state_path(self) -> Path:
        from .registry import swiftk_home

        fp = hashlib.sha256(repr(sorted(self.identity.items())).encode()).hexdigest()[:12]
        name = "".join(c if c.isalnum() or c in "-._" else "_" for c in str(self.identity.get("name") or "model"))
        kind = "cpu" if self.device.type == "cpu" else torch.cuda.get_device_name(self.device).replace(" ", "_")
        dt = str(self.dtype).replace("torch.", "") + (f"-w{self.model.weights}" if self.model.weights else "")
        return swiftk_home() / "state" / f"{name}-{fp}-{kind}-{dt}.json"

    def _load_persisted(self, cfg) -> None:
        path = self.state_path()
        if not path.exists():
            return
        try:
            self.state = SkipSetState.load(path, self.identity, self.config.n_layers, cfg)
            import json

            costs = json.loads(path.read_text()).get("costs") or {}
            if costs.get("threads") == torch.get_num_threads():
                self.costs.load_dict(costs)
        except (SwiftkError, ValueError, TypeError, OSError) as e:
            warnings.warn(f"swiftk: ignoring the saved decoding state ({e}); starting fresh", stacklevel=3)

    def _save_persisted(self) -> None:
        try:
            self.state.save(self.state_path(), self.identity,
                            {"costs": {**self.costs.to_dict(), "threads": torch.get_num_threads()}})
        except (OSError, SwiftkError) as e:
            if not getattr(self, "_warned_save", False):
                self._warned_save = True
                warnings.warn(f"swiftk: cannot save the decoding state ({e}); continuing without", stacklevel=3)

    # ------------------------------------------------------------------ generation
    def encode_prompt(self, prompt, chat: bool = False) -> list:
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in prompt):
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
                raise SwiftkError(f"prompt must be a string, a list of token ids or (chat=True) messages, "
                                  f"got {type(prompt).__name__}")
            ids = self.tokenizer.encode(prompt)
        if not prompt or not ids:
            raise SwiftkError("prompt is empty")
        return ids

    def generate(self, prompt, max_new_tokens: int = 128, method: str = "swift", temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None, stop: Sequence[str] = (),
                 chat: bool = False, callback: Optional[Callable[[str], None]] = None,
                 progress: bool = False, exit_layer: Optional[int] = None, skip_set=None,
                 state: Optional[SkipSetState] = None, _cancel: Optional[threading.Event] = None,
                 **options) -> GenerationResult:
        """Generate a continuation; greedy when temperature == 0.

        ``method``: "swift" (default: layer-skip draft with the learned skip set + context n-grams, each used
        when the cost model expects it to pay), "autoregressive", "early_exit" (draft = layers 0..exit_layer-1,
        then the LM head), "static" (draft with a fixed ``skip_set``, e.g. from ``swiftk optimize``), "moa" (the
        trained Mixture-of-Attentions drafter, see :meth:`load_drafter`) or "ngram"
        (prompt lookup only). ``skip_set``: a JSON path, a dict {"attention": [...], "mlp": [...]} or a bool
        tensor [2L]. ``state``: the learned state to use and update (default: the engine's). ``options``: decode
        options (config.DecodeConfig) for this call; optimizer options are rejected here (they shape the learned
        state: ``reset_optimizer(...)``). Seeded sampling gives the same tokens for the same (model, dtype,
        device, prompt, sampling options, seed) whatever the method or learned state (coupled sampling).
        """
        if method not in METHODS:
            raise SwiftkError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
        decode_kw, opt_kw = split_options(options)
        if opt_kw:
            k = sorted(opt_kw)[0]
            raise SwiftkError(f"{', '.join(sorted(opt_kw))}: optimizer option(s) shape the learned state, not one "
                              f"call; use eng.reset_optimizer({k}={opt_kw[k]!r}) or swiftk.load(..., {k}=...)")
        if method == "early_exit" and "kvq" not in decode_kw:
            # the exit boundary sits mid-model: reusing the layers below it cut the CPU verify pass to 0.86-0.88x
            # (python -m bench.kvq); layer-skip sets start skipping near layer 1, so there it is off by default
            decode_kw["kvq"] = True
        cfg = updated(self.decode_config, decode_kw) if decode_kw else self.decode_config
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise SwiftkError(f"stop must be a string or a list of strings, got {stop!r}")
        if not callable(callback) and callback is not None:
            raise SwiftkError("callback must be callable")
        if state is not None and not isinstance(state, SkipSetState):
            raise SwiftkError(f"state must be a SkipSetState (eng.new_state()), got {type(state).__name__}")
        sp = SamplingParams(temperature, top_k, top_p, seed).validate()
        fixed = self._fixed_skip(method, exit_layer, skip_set, "optimize" in decode_kw and cfg.optimize)
        ids = self.encode_prompt(prompt, chat)
        check_lengths(len(ids), max_new_tokens, self.max_context, self.config.max_position)

        with self._lock:
            if method == "moa" and self._moa is None:
                self.load_drafter(None)
            if method != "autoregressive" and cfg.datastore:
                self.datastore()   # built (or read) once, before the timed loop
            if method not in ("autoregressive", "ngram") and self._head_size(cfg.draft_vocab):
                self._head_for(cfg.draft_vocab)   # likewise the draft head (its token ranking: ~2 s once per machine)
            if state is None:
                state = self.state if fixed is None and method not in ("ngram", "moa") else \
                    self._state_for(method, fixed)
            return self._generate(ids, max_new_tokens, method, sp, stop, callback, progress, exit_layer, fixed,
                                  state, cfg, _cancel)

    def _state_for(self, method: str, fixed: Optional[torch.Tensor]) -> SkipSetState:
        """The acceptance statistics of a fixed draft (its own per set, a few kept)."""
        key = method if fixed is None else bytes(fixed.to(torch.uint8).tolist())
        st = self._fixed_states.pop(key, None) or SkipSetState(self.config.n_layers, self.state.cfg)
        self._fixed_states[key] = st  # most recently used last
        while len(self._fixed_states) > 8:
            del self._fixed_states[next(iter(self._fixed_states))]
        return st

    def _generate(self, ids, max_new_tokens, method, sp, stop, callback, progress, exit_layer, fixed, state, cfg,
                  cancel) -> GenerationResult:
        bar = None
        cb = callback
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=max_new_tokens, unit="tok", leave=False)

            def cb(piece, _inner=callback):
                bar.n = len(sink.ids)
                bar.refresh()
                if _inner:
                    _inner(piece)
        sink = TokenSink(self.tokenizer, max_new_tokens, stop, cb, cancel)
        sampler = Sampler(sp, self.device, cfg.sampling)
        t0 = time.perf_counter()
        try:
            if method == "autoregressive":
                stats = autoregressive(self.model, self.cache, ids, sampler, sink)
            else:
                head = None
                if method != "ngram" and self._head_size(cfg.draft_vocab):
                    head = lambda: self._head_for(cfg.draft_vocab)  # noqa: E731 - built at the first draft step
                stats = swift_decode(self.model, self.cache, state, self.costs, ids, sampler, sink, cfg,
                                     skip=None if fixed is None else fixed.to(self.device), head=head,
                                     layer_draft=method != "ngram", moa=self._moa if method == "moa" else None,
                                     datastore=self._datastore if cfg.datastore else None)
        finally:
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - t0
        state.history.add(sink.ids)   # every output decoded with this state drafts for later prompts (history=)
        stats.method, stats.new_tokens, stats.prompt_tokens = method, len(sink.ids), len(ids)
        stats.wall_time_s, stats.tokens_per_s = wall, rate(len(sink.ids), wall)
        stats.exit_layer = exit_layer if method == "early_exit" else None
        if self.persist and method != "autoregressive" and state is self.state:
            self._save_persisted()
        return GenerationResult(text=sink.text, token_ids=list(sink.ids), prompt_ids=ids,
                                finish_reason=sink.finish_reason, stats=stats)

    def datastore(self):
        """The corpus n-gram tables for this model's tokenizer (swiftk/datastore.py): read from
        ``$SWIFTK_HOME/datastore`` or built there once (~10 s), kept in memory for this engine."""
        from .datastore import Datastore, stdlib_datastore

        if self._datastore is None:
            try:
                ds = stdlib_datastore(self.tokenizer, str(self.identity.get("fingerprint") or ""))
                if ds.max_token() >= self.config.vocab_size:
                    raise SwiftkError(f"the corpus maps to token ids >= the model's vocabulary ({self.config.vocab_size})")
            except Exception as e:  # noqa: BLE001 - a tokenizer that cannot encode the corpus (a custom one)
                warnings.warn(f"swiftk: no corpus n-grams for this tokenizer ({type(e).__name__}: {str(e)[:200]}); "
                              "decoding without them")
                ds = Datastore.build([])   # empty: proposes nothing, and is not rebuilt at every call
            self._datastore = ds
        return self._datastore

    # ------------------------------------------------------------------ the MoA drafter
    def trained_drafter_path(self) -> Path:
        """``$SWIFTK_HOME/drafters/<name>-<fingerprint>.safetensors``: where ``swiftk train-drafter`` writes."""
        from .registry import swiftk_home

        name = str(self.identity.get("name") or "model")
        fp = str(self.identity.get("fingerprint") or "")[:12]
        return swiftk_home() / "drafters" / f"{name}-{fp}.safetensors"

    def drafter_path(self) -> Path:
        """Where this model's drafter is looked for: the trained one, else the one shipped with the package."""
        home = self.trained_drafter_path()
        shipped = Path(__file__).parent / "moa" / "drafters" / f"{self.identity.get('name')}.safetensors"
        return home if home.is_file() or not shipped.is_file() else shipped

    def load_drafter(self, path=None) -> None:
        """Load a trained MoA drafter (``path``, default :meth:`drafter_path`) for ``method="moa"``."""
        from .moa.model import load
        from .moa.runner import MoARunner

        p = Path(path) if path is not None else self.drafter_path()
        if path is None and not p.is_file():
            name = self.identity.get("name") or "<model>"
            raise SwiftkError(f"no MoA drafter for {name!r} (looked for {p}); train one with `swiftk train-drafter "
                              f"--model {name}` or pass swiftk.load(..., drafter=PATH)")
        drafter, extra = load(p, self.config, self.identity, self.device)
        self._moa = MoARunner(drafter, self.model, self.cache.max_slots)
        self._moa_info = {"path": str(p), "tli": drafter.cfg.tli, "lsa": drafter.cfg.lsa,
                          "parameters": drafter.n_params(), **{k: extra[k] for k in extra if k != "history"}}

    def _head_size(self, size: int) -> int:
        """The draft vocabulary size in use: 0 (the full head) when a subset would not be much smaller."""
        size = size if 0 < size < self.config.vocab_size // 2 else 0
        if not size:
            self.costs.draft_head_bytes = None
        return size

    def _head_for(self, size: int):
        """The reduced-vocabulary draft head for one call: the ``size`` most frequent tokens (the loop adds every
        token of the context). Built once per engine, before the first call that may draft (generate), so a call's
        timings hold decoding only."""
        if self._draft_head is None or self._draft_head[0] != size:  # (size, base count, head)
            from .registry import swiftk_home
            from .vocab import DraftHead, frequent_token_ids

            base = frequent_token_ids(self.tokenizer, size, cache_dir=swiftk_home() / "draft_vocab",
                                      model_name=str(self.identity.get("name") or "model"))
            self._draft_head = (size, len(base),
                                DraftHead(self.model.lm_head, base.to(self.device), len(base) + self.max_context + 64))
        _, n_base, head = self._draft_head
        head.truncate(n_base)
        self.costs.draft_head_bytes = head.weight_bytes
        return head

    def _fixed_skip(self, method: str, exit_layer, skip_set, optimize: bool) -> Optional[torch.Tensor]:
        """The draft's skip set when it is fixed for this call (early exit, static set), else None (the state's)."""
        L = self.config.n_layers
        if exit_layer is not None and method != "early_exit":
            raise SwiftkError(f"exit_layer is an option of method='early_exit', not {method!r}")
        if method == "early_exit":
            if exit_layer is None:
                raise SwiftkError("method='early_exit' needs exit_layer=E (the draft runs layers 0..E-1)")
            if skip_set is not None:
                raise SwiftkError("method='early_exit' takes exit_layer, not skip_set")
            return skipset.early_exit(L, exit_layer)
        if skip_set is None:
            if method == "static":
                raise SwiftkError("method='static' needs skip_set=PATH (a file from save_skip_set or swiftk optimize)")
            return None
        if method in ("autoregressive", "ngram", "moa"):
            raise SwiftkError(f"skip_set is an option of the layer-skip methods, not {method!r}")
        if optimize:
            raise SwiftkError("skip_set=... decodes with that set without optimizing; to keep optimizing from it "
                              "use engine.load_skip_set(path, optimize=True)")
        return skipset.coerce(skip_set, L, self.identity)

    def stream(self, prompt, **kw) -> Iterator[str]:
        """Iterator over text pieces (generation runs in a worker thread). Abandoning the iterator cancels the
        generation at its next token, so the engine is free again."""
        import queue

        q: queue.Queue = queue.Queue()
        done, box, cancel = object(), {}, threading.Event()

        def run():
            try:
                box["result"] = self.generate(prompt, callback=q.put, _cancel=cancel, **kw)
            except BaseException as e:  # surfaced in the consumer
                box["error"] = e
            finally:
                q.put(done)

        th = threading.Thread(target=run, daemon=True, name="swiftk-stream")
        th.start()
        try:
            while (item := q.get()) is not done:
                yield item
        finally:
            cancel.set()
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
        T = len(ids)
        with self._lock:
            self.cache.reset()
            return self.model.forward(torch.tensor(ids, device=dev), torch.arange(T, device=dev),
                                      torch.arange(T, device=dev), self.cache)

    def info(self) -> dict:
        from .ops import cpu_linear, describe

        c = self.config
        o = self.state.optimizer
        return {"model": self.identity, "config": c.to_dict(), "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "weights": self.model.weights,
                "parameters": self.model.n_params(),
                "weight_bytes": self.model.weight_bytes(), "max_context": self.max_context,
                "kv_cache_bytes": self.cache.data.numel() * self.cache.data.element_size(),
                "backends": describe(self.device),
                "linear": cpu_linear.status() if self.device.type == "cpu" else "torch matmul",
                "layer_loop": ("fused C loop (kernels/cpu_decode.cpp) for passes of <= 32 tokens"
                               if self.model._fused_ok and cpu_linear.fused_active() else "torch, op by op"),
                "costs": self.costs.to_dict(), "drafter": self._moa_info,
                "cuda_graphs": self.model.graphs.info() if self.model.graphs is not None else None,
                "decode_config": {k: getattr(self.decode_config, k) for k in sorted(_DECODE_OPTS)},
                "optimizer_config": {k: getattr(self.state.cfg, k) for k in sorted(_OPT_OPTS)},
                "state": {"skip_set": skipset.to_layers(self.skip_set), "tokens_seen": self.state.tokens_seen,
                          "optimization_steps": o.steps, "optimization_done": o.done,
                          "best_matchness": o.best_matchness,
                          "file": str(self.state_path()) if self.persist else None}}
