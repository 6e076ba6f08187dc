"""Engine: owns the model, the KV cache, the tokenizer, the cost model, the learned states and the resources
built once (draft head, corpus tables, trained drafters).

One call of :meth:`Engine.generate` holds the engine's lock (two threads calling it serialize; the KV cache has one
owner at a time), has its options checked before any work (calls.Calls.request) and goes to a scheduler of one
slot, like every call: the scheduler opens it on a batch slot and closes it through the engine's
:class:`~swiftk.calls.Calls`, and runs its rounds (decoding/loop.py) in the batch's shared passes.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from . import methods
from .runtime import skipset
from .options import DecodeConfig, OptimizerConfig, option_names, split_options, updated
from .target.costs import CostModel
from .errors import SwiftkError
from .files import check_output_path
from .decoding.output import GenerationResult, stream_pieces
from .decoding.passes import full_logits, timed_passes
from .decoding.prefix import may_reuse
from .runtime.model import KERNEL_MAX_ROWS, Model, check_device_dtype, resolve_device, resolve_dtype
from .runtime.ops import cpu_layers, cpu_linear, describe
from .runtime.weights import weight_pages
from .proposers.datastore import CorpusTables, Datastore
from .proposers.draft_head import target_draft_head
from .proposers.draft_model import load_draft_model
from .decoding.state import LearnedState, LearnedStates, state_file
from .calls import Calls
from .requests import Request, SlotPool, check_max_batch
from .scheduler import Scheduler
from .target import Target

SCRATCH = 128   # slots past the context for the draft / matchness / verify scratch (context_window <= 120, trees <= 64)
_DECODE_OPTS = option_names(DecodeConfig)
_OPT_OPTS = option_names(OptimizerConfig)


class Engine:
    def __init__(self, checkpoint, device="cpu", dtype="float32", max_context: Optional[int] = None,
                 persist: Optional[bool] = None, weights: Optional[str] = None, activations: Optional[str] = None,
                 drafter=None, draft_model=None, kv_cache: Optional[str] = None,
                 cuda_graphs: Optional[bool] = None, **options):
        """``options``: decode options (defaults for every call) and optimizer options (the learned state's).
        ``weights``: None, "native" (blocks: load_checkpoint(native=True)), "bfloat16" or "int8"; ``activations``:
        None, "int8" or "float32" for native weights; ``kv_cache``: the KV cache's element type (see :class:`Model`;
        default float16 for native weights with int8 activations, else the compute dtype).
        ``persist`` (default: True for registry/file models): keep the learned state and the cost model in
        ``$SWIFTK_HOME/state`` so the next process starts warm. ``drafter``: path of a trained MoA drafter for
        ``method="moa"`` (experimental; default: found by model name). ``draft_model``: the checkpoint of a smaller
        model with the same tokenizer, loaded with the same options, drafting for ``method="draft_model"`` (then
        the default method). ``cuda_graphs``: None (on for CUDA unless SWIFTK_CUDA_GRAPHS=0), True or False."""
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        check_device_dtype(self.device, self.dtype)
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.identity = dict(checkpoint.identity)
        decode_kw, opt_kw = split_options(options)
        self.decode_config = updated(DecodeConfig(), decode_kw)
        self._prefix_asked = decode_kw.get("prefix_cache") is True   # reuse asked for, not the default's "where exact"
        opt_cfg = updated(OptimizerConfig(), opt_kw)
        ctx = self.config.max_position
        if max_context is None:
            max_context = min(ctx, 4096)
        if ctx < 2:
            raise SwiftkError(f"the model's context length is {ctx} tokens (config or GGUF context_length); "
                              f"decoding needs at least 2")
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
            raise SwiftkError(f"max_context must be an int >= 2, got {max_context!r}")
        if max_context > ctx:
            raise SwiftkError(f"max_context {max_context} exceeds the model's context length {ctx}")
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise SwiftkError(f"cuda_graphs must be True, False or None, got {cuda_graphs!r}")
        if cuda_graphs and self.device.type != "cuda":
            raise SwiftkError(f"cuda_graphs=True needs a CUDA device, got {self.device}")
        if persist is not None and not isinstance(persist, bool):
            raise SwiftkError(f"persist must be True, False or None, got {persist!r}")
        if kv_cache is None and weights == "native" and activations in (None, "int8"):
            kv_cache = "float16"   # llama.cpp's arithmetic, its cache too; activations="float32" stays the exact model
        self.model = Model(self.config, checkpoint.tensors, device=self.device, dtype=self.dtype, weights=weights,
                           activations=activations, kv_cache=kv_cache)
        checkpoint.tensors = {}  # the model holds its own (fused) copies; free the loader's
        may_reuse(self.decode_config.prefix_cache, self._prefix_asked, self.model)   # asked where inexact: refused
        self.max_context = max_context
        self.cache = self.model.new_cache(max_context + SCRATCH)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and os.environ.get("SWIFTK_CUDA_GRAPHS", "1") != "0"
        if cuda_graphs:
            self.model.enable_graphs(self.cache)
        costs = CostModel(self.model)
        if self.device.type == "cpu":   # 8 passes (31 ms on SmolLM2, 0.23 s on a 1.5B) that also page weights in
            costs.calibrate(*timed_passes(self.model, self.cache, 8), 8)
        self.target = Target(self.model, self.tokenizer, self.identity, max_context, self.cache.max_slots, costs,
                             drafter)
        self._lock = threading.RLock()
        self._busy, self._owner = False, None   # a call holds the KV cache (see hold)
        self.slots = SlotPool(self.model, self.cache, max_context + SCRATCH)   # batch slots; slot 0's is self.cache
        if persist is None:  # SWIFTK_PERSIST=0 turns persistence off by default (tests, benchmarks)
            persist = os.environ.get("SWIFTK_PERSIST", "1") != "0" and bool(self.identity.get("fingerprint"))
        self.states = LearnedStates(self.config.n_layers, opt_cfg, self.identity, state_file(
            self.identity, self.device, self.dtype, self.model.weights, self.model.activations) if persist else None,
            self.target)
        if draft_model is not None:   # its vocabulary checked against ours, its cache beside ours
            self.set_resource("draft_model", load_draft_model(self.target, draft_model, weights, activations,
                                                              self.decode_config.draft_vocab))
        self.corpus_tables = CorpusTables(self.target)   # started now when drafts use them
        if self.decode_config.datastore:
            self.corpus_tables.start()
        self.calls = Calls(self.target, self.slots, self.states, self.decode_config, self._prefix_asked,
                           self.corpus_tables)
        # what generate's default method builds once (SWIFT's draft head: its token ranking takes ~1 s on a fresh
        # $SWIFTK_HOME) is built here, so a user's first call does not wait for it
        methods.get(self.default_method).prepare(self.target, self.decode_config)
        if drafter is not None:
            methods.get("moa").prepare(self.target, self.decode_config)
        self.states.load(opt_cfg if opt_kw else None)

    @property
    def costs(self) -> CostModel:
        """The measured cost model (the target's: every method and drafter prices with the same one)."""
        return self.target.costs

    @costs.setter
    def costs(self, costs: CostModel) -> None:
        self.target.costs = costs

    @property
    def default_method(self) -> str:
        """generate's method when none is named: "draft_model" on an engine loaded with one, else "swift"."""
        return self.calls.default_method

    # ------------------------------------------------------------------ the learned state
    @property
    def persist(self) -> bool:
        """Whether the learned state and the cost model are kept in ``$SWIFTK_HOME/state`` (fixed at load)."""
        return self.states.path is not None

    @property
    def state(self) -> LearnedState:
        """The learned state of SWIFT (the default method), the one that persists."""
        return self.states.main

    @state.setter
    def state(self, st: LearnedState) -> None:
        self.states.main = st

    @property
    def skip_set(self) -> torch.Tensor:
        return self.state.skip_set

    @skip_set.setter
    def skip_set(self, s) -> None:
        self.state.skip_set = skipset.check(s, self.config.n_layers)

    @property
    def optimizer(self):
        return self.state.optimizer

    def new_state(self, **optimizer_options) -> LearnedState:
        """A fresh learned state (e.g. one per workload in a benchmark): pass it as ``generate(..., state=)``."""
        return self.states.new(updated(self.state.cfg, optimizer_options))

    def reset_optimizer(self, **optimizer_options) -> None:
        """Forget what was learned: back to the uniform skip set and a fresh optimizer (with these options)."""
        _, opt_kw = split_options(optimizer_options)
        bad = set(optimizer_options) - set(opt_kw)
        if bad:
            raise SwiftkError(f"{', '.join(sorted(bad))}: decode option(s), give them to generate(), not "
                              "reset_optimizer()")
        self.state = self.new_state(**opt_kw)

    def save_skip_set(self, path: Union[str, os.PathLike], skip_set: Optional[torch.Tensor] = None, **extra) -> None:
        check_output_path(path, "skip-set file")
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

    # ------------------------------------------------------------------ generation
    def generate(self, prompt, max_new_tokens: int = 128, method: Optional[str] = None, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None, stop: Sequence[str] = (),
                 chat: bool = False, callback: Optional[Callable[[str], None]] = None,
                 progress: bool = False, exit_layer: Optional[int] = None, skip_set=None,
                 state: Optional[LearnedState] = None, proposers: Sequence = (),
                 _cancel: Optional[threading.Event] = None, logprobs: Optional[int] = None,
                 grammar=None, **options) -> GenerationResult:
        """Generate a continuation; greedy when temperature == 0.

        ``method``: one of ``swiftk.methods.names()``: "swift" (the default; "draft_model" on an engine loaded with a
        draft model), "autoregressive" (the reference: reads and writes no learned state), "early_exit"
        (``exit_layer=E``), "static" (``skip_set=``), "ngram" (free drafts only), "moa" (experimental). ``skip_set``: a
        JSON path, a dict {"attention": [...], "mlp": [...]} or a bool tensor [2L]. ``state``: the learned state to use
        and update (default: the engine's, per method). ``proposers``: your own draft sources, objects with
        ``propose(tokens) -> list[int]``, priced and gated like the built-in free drafts; ``callback(piece)`` gets the
        text as it comes (an exception it raises ends the call and propagates unchanged). ``options``: decode options
        (options.DecodeConfig) for this call. Seeded sampling gives the same tokens for the same (model, dtype, device,
        prompt, sampling options, seed) whatever the method or learned state (coupled sampling). ``logprobs=K``
        (0..20): ``result.logprobs`` holds each token's log-probability under the target and its K likeliest
        alternatives (decoding.output.TokenLogprobs: the same with or without speculation). ``grammar``: a
        swiftk.Grammar the output must match (JSON Schema, JSON object, regex, Lark; decoding/grammar.py).
        """
        req = self.calls.request(prompt, max_new_tokens=max_new_tokens, method=method, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=seed, stop=stop, chat=chat, callback=callback,
                                 progress=progress, exit_layer=exit_layer, skip_set=skip_set, state=state,
                                 proposers=proposers, _cancel=_cancel, logprobs=logprobs, grammar=grammar, **options)
        return self.decode([req], 1)[0]

    def generate_many(self, prompts: Sequence, max_batch: Optional[int] = None, **kw) -> list:
        """``generate(p, **kw)`` for every prompt, decoded together: up to ``max_batch`` calls at once (default:
        ``default_max_batch``), their rounds' target passes merged into one pass, a waiting prompt joining as
        another finishes. Each result equals ``generate(p, **kw)`` alone (same tokens: every row is computed as it
        would be alone). Every prompt is checked before any decodes; a call that fails raises after the others
        finish (the first such error)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise SwiftkError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        if "callback" in kw or "_cancel" in kw or kw.get("progress"):
            raise SwiftkError("generate_many takes no callback or progress (one call's options); use generate")
        max_batch = check_max_batch(self.default_max_batch if max_batch is None else max_batch)
        reqs = [self.calls.request(p, **kw) for p in prompts]
        max_batch = max(1, min(max_batch, len(reqs)))   # KV caches for the calls there are, not for the cap
        self.slots.reserve(max_batch, f"generate_many of {len(reqs)} prompt(s) at max_batch={max_batch}")
        return self.decode(reqs, max_batch)

    def decode(self, reqs: Sequence[Request], max_batch: int) -> list:
        """The results of ``reqs`` (from ``eng.calls.request``), decoded by one scheduler with ``max_batch`` slots: the one
        road of every call (a lone ``generate`` is a batch of one). A call that fails raises after the others
        finish (the first such error, unchanged); an interrupt ends every call and propagates."""
        check_max_batch(max_batch)
        bad = [r for r in reqs if not isinstance(r, Request)]
        if bad:
            raise SwiftkError(f"decode takes Requests (eng.calls.request(...)), got {type(bad[0]).__name__}")
        out: list = [None] * len(reqs)
        errors: list = []
        with self.hold():
            sched = Scheduler(self.calls, max_batch, whole_prompts=max_batch == 1)
            for i, r in enumerate(reqs):
                sched.submit(r, lambda res, err, i=i: errors.append(err) if err is not None else out.__setitem__(i, res))
            try:
                sched.run_until_idle()
            except BaseException as e:   # Ctrl-C mid-round: every call ends (its progress bar, its slot's record)
                sched.cancel_all(e)
                raise
        if errors:
            raise errors[0]
        return out

    @contextlib.contextmanager
    def hold(self):
        """The engine (its KV caches, its learned states) for one caller's rounds: other threads wait; a call from
        inside them (a callback calling back into the engine) would reset a KV cache under it, so it is refused."""
        with self._lock:
            self._refuse_reentry()
            self._busy, self._owner = True, threading.get_ident()
            try:
                yield
            finally:
                self._busy, self._owner = False, None

    def _refuse_reentry(self) -> None:
        if self._busy and self._owner == threading.get_ident():
            raise SwiftkError("this engine is decoding: a callback cannot call back into the same engine "
                              "(use another engine, or collect the text and call after generate returns)")

    # ------------------------------------------------------------------ from a user's arguments to a call's result
    def encode_prompt(self, prompt, chat: bool = False, tools: Optional[list] = None) -> list:
        """Token ids of a prompt: ids as given, a text, or (``chat``) messages in the chat template, which shows
        the model ``tools`` (OpenAI's tool specs) when given (Target.encode_prompt)."""
        return self.target.encode_prompt(prompt, chat, tools)

    @property
    def prompt_char_limit(self) -> int:
        """No text over this many characters fits the context (Target.prompt_char_limit)."""
        return self.target.prompt_char_limit

    @property
    def default_max_batch(self) -> int:
        """Calls decoded together when not told (requests.default_max_batch: by cores and available memory)."""
        return self.slots.default_max_batch()

    # ------------------------------------------------------------------ built once per engine
    def resource(self, name, make: Optional[Callable] = None):
        """An object built once per engine (draft head, corpus, trained drafter): ``make()`` at first use."""
        return self.target.resource(name, make)

    def set_resource(self, name, value) -> None:
        with self._lock:   # not while a call decodes: a resource swapped mid-round would serve half a round
            self.target.set_resource(name, value)

    def corpus(self, wait: bool = False) -> Datastore:
        """The corpus n-gram tables the "datastore" source drafts from (proposers.datastore.CorpusTables.get: empty
        until built; ``wait`` blocks until they are)."""
        return self.corpus_tables.get(wait)

    def use_corpus(self, datastore: Datastore) -> None:
        """Draft corpus n-grams from ``datastore`` (``swiftk.proposers.datastore.Datastore.build(token_ids)``)."""
        self.corpus_tables.use(datastore)

    def draft_head(self, size: int, slot: int = 0):
        """The reduced-vocabulary draft head (proposers.draft_head.DraftHead: the ``size`` most frequent tokens; the
        drafter adds every token of the context) of the calls on batch slot ``slot``, reset for a new call; None
        when a subset would not be much smaller than the vocabulary (``size`` 0: the full LM head). Its token
        ranking takes ~2 s once per machine."""
        return target_draft_head(self.target, size, slot)

    def stream(self, prompt, **kw) -> Iterator[str]:
        """Iterator over text pieces (generation runs in a worker thread). Abandoning the iterator cancels the
        generation at its next token, so the engine is free again."""
        if "callback" in kw or "_cancel" in kw:
            raise SwiftkError("stream() yields the pieces itself; callback is an option of generate()")
        self._refuse_reentry()   # the stream's worker would wait forever for the lock this thread holds
        return stream_pieces(self.generate, prompt, **kw)

    @torch.inference_mode()
    def logits(self, token_ids) -> torch.Tensor:
        """Full-model logits [T, vocab] (float32) for a whole sequence, for reference checks."""
        ids = list(token_ids)
        if not ids:
            raise SwiftkError("token_ids is empty")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.config.vocab_size]
        if bad:
            raise SwiftkError(f"token id {bad[0]!r} is not an int in [0, {self.config.vocab_size})")
        if len(ids) > self.max_context:
            raise SwiftkError(f"{len(ids)} tokens exceed the context ({self.max_context})")
        with self.hold():
            return full_logits(self.model, self.cache, ids)

    def info(self) -> dict:
        c, o = self.config, self.state.optimizer
        return {"model": self.identity, "config": c.to_dict(), "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "weights": self.model.weights,
                "activations": self.model.activations or str(self.dtype).replace("torch.", ""),
                "arithmetic": self.model.arithmetic(),
                "parameters": self.model.n_params(), "weight_bytes": self.model.weight_bytes(),
                "resident_weight_bytes": self.model.resident_bytes(),
                "weight_pages": weight_pages(self.model),
                "weight_formats": self.model.formats(), "max_context": self.max_context,
                "kv_cache": str(self.cache.data.dtype).replace("torch.", ""),
                "kv_cache_bytes": self.cache.data.numel() * self.cache.data.element_size(),
                "backends": describe(self.device),
                "linear": cpu_linear.status() if self.device.type == "cpu" else "torch matmul",
                "layer_loop": (f"fused C loop (kernels/cpu/cpu_decode.cpp), passes of <= {KERNEL_MAX_ROWS} tokens "
                               "(longer causal prefills in passes of that size)"
                               if self.model.fused_ok and cpu_layers.fused_active() else "torch, op by op"),
                "costs": self.costs.to_dict(), "drafter": getattr(self.resource("drafter"), "info", None),
                "draft_model": getattr(self.resource("draft_model"), "info", None),
                "cuda_graphs": self.model.graphs.info() if self.model.graphs is not None else None,
                "decode_config": {k: getattr(self.decode_config, k) for k in sorted(_DECODE_OPTS)},
                "optimizer_config": {k: getattr(self.state.cfg, k) for k in sorted(_OPT_OPTS)},
                "state": {"skip_set": skipset.to_layers(self.skip_set), "tokens_seen": self.state.tokens_seen,
                          "optimization_steps": o.steps, "optimization_done": o.done,
                          "best_matchness": o.best_matchness,
                          "file": str(self.states.path) if self.states.path else None}}
