"""Engine: the user's handle on one loaded model. It builds and owns the :class:`~swiftk.target.Target` (model,
tokenizer, cost model, resources built once), the batch slots' KV caches, the learned states and the corpus
tables, and hands every call to :class:`~swiftk.calls.Calls`: checked once, decoded by a scheduler (a lone
``generate`` is a batch of one) in rounds of decoding/loop.py.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional, Sequence

import torch

from . import methods
from .calls import Calls
from .decoding.output import GenerationResult, stream_pieces
from .decoding.passes import full_logits
from .decoding.prefix import may_reuse
from .decoding.state import LearnedState, LearnedStates, state_file
from .errors import SwiftkError
from .options import DecodeConfig, OptimizerConfig, option_names, split_options, updated
from .proposers.datastore import CorpusTables, Datastore
from .proposers.draft_head import target_draft_head
from .proposers.draft_model import load_draft_model
from .requests import SlotPool
from .runtime import skipset
from .target.costs import CostModel
from .target.load import load_target

SCRATCH = 128   # slots past the context for the draft / matchness / verify scratch (context_window <= 120, trees <= 64)


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
        decode_kw, opt_kw = split_options(options)
        self.decode_config = updated(DecodeConfig(), decode_kw)
        prefix_asked = decode_kw.get("prefix_cache") is True   # reuse asked for, not the default's "where exact"
        opt_cfg = updated(OptimizerConfig(), opt_kw)
        if persist is not None and not isinstance(persist, bool):
            raise SwiftkError(f"persist must be True, False or None, got {persist!r}")
        self.target, self.cache = load_target(checkpoint, device=device, dtype=dtype, max_context=max_context,
                                              weights=weights, activations=activations, kv_cache=kv_cache,
                                              cuda_graphs=cuda_graphs, drafter=drafter, scratch=SCRATCH)
        t = self.target
        self.model, self.tokenizer, self.config, self.identity = t.model, t.tokenizer, t.config, t.identity
        self.device, self.dtype, self.max_context = t.device, t.dtype, t.max_context
        may_reuse(self.decode_config.prefix_cache, prefix_asked, self.model)   # asked where inexact: refused
        self.slots = SlotPool(self.model, self.cache, t.kv_slots)   # batch slots; slot 0's is self.cache
        if persist is None:  # SWIFTK_PERSIST=0 turns persistence off by default (tests, benchmarks)
            persist = os.environ.get("SWIFTK_PERSIST", "1") != "0" and bool(self.identity.get("fingerprint"))
        self.states = LearnedStates(self.config.n_layers, opt_cfg, self.identity, state_file(
            self.identity, self.device, self.dtype, self.model.weights, self.model.activations) if persist else None, t)
        if draft_model is not None:   # its vocabulary checked against ours, its cache beside ours
            t.set_resource("draft_model", load_draft_model(t, draft_model, weights, activations,
                                                           self.decode_config.draft_vocab))
        self.corpus_tables = CorpusTables(t)   # started now when drafts use them
        if self.decode_config.datastore:
            self.corpus_tables.start()
        self.calls = Calls(t, self.slots, self.states, self.decode_config, prefix_asked, self.corpus_tables)
        # what generate's default method builds once (SWIFT's draft head: its token ranking takes ~1 s on a fresh
        # $SWIFTK_HOME) is built here, so a user's first call does not wait for it
        methods.get(self.default_method).prepare(t, self.decode_config)
        if drafter is not None:
            methods.get("moa").prepare(t, self.decode_config)
        self.states.load(opt_cfg if opt_kw else None)

    @property
    def costs(self) -> CostModel:
        """The measured cost model (the target's: every method and drafter prices with the same one; replace it
        there, ``eng.target.costs = ...``)."""
        return self.target.costs

    @property
    def default_method(self) -> str:
        """generate's method when none is named: "draft_model" on an engine loaded with one, else "swift"."""
        return self.calls.default_method

    # ------------------------------------------------------------------ the learned state
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
        self.states.reset(optimizer_options)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt, max_new_tokens: int = 128, **options) -> GenerationResult:
        """Generate a continuation; greedy when temperature == 0. The options, checked before any work, are
        :meth:`swiftk.calls.Calls.request`'s: ``method``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``,
        ``chat``, ``callback``, ``progress``, ``exit_layer``, ``skip_set``, ``state``, ``proposers``, ``logprobs``,
        ``grammar``, and the decode options (options.DecodeConfig) for this call.

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
        return self.calls.decode([self.calls.request(prompt, max_new_tokens=max_new_tokens, **options)], 1)[0]

    def generate_many(self, prompts: Sequence, max_batch: Optional[int] = None, **kw) -> list:
        """``generate(p, **kw)`` for every prompt, decoded together: up to ``max_batch`` calls at once (default:
        ``requests.default_max_batch``, by cores and memory), their rounds' target passes merged into one pass, a
        waiting prompt joining as another finishes. Each result equals ``generate(p, **kw)`` alone (same tokens:
        every row is computed as it would be alone). Every prompt is checked before any decodes; a call that fails
        raises after the others finish (the first such error)."""
        return self.calls.decode_many(prompts, self.slots.default_max_batch() if max_batch is None else max_batch,
                                      **kw)

    # ------------------------------------------------------------------ from a user's arguments to a call's result
    def encode_prompt(self, prompt, chat: bool = False, tools: Optional[list] = None) -> list:
        """Token ids of a prompt: ids as given, a text, or (``chat``) messages in the chat template, which shows
        the model ``tools`` (OpenAI's tool specs) when given (Target.encode_prompt)."""
        return self.target.encode_prompt(prompt, chat, tools)

    def set_resource(self, name, value) -> None:
        with self.calls.lock:   # not while a call decodes: a resource swapped mid-round would serve half a round
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
        self.calls.refuse_reentry()   # the stream's worker would wait forever for the lock this thread holds
        return stream_pieces(self.generate, prompt, **kw)

    @torch.inference_mode()
    def logits(self, token_ids) -> torch.Tensor:
        """Full-model logits [T, vocab] (float32) for a whole sequence, for reference checks."""
        ids = self.target.check_sequence(token_ids)
        with self.calls.hold():
            return full_logits(self.model, self.cache, ids)

    def info(self) -> dict:
        """What this engine runs and has learned (``swiftk info``): the target's, the KV cache's, the options'."""
        kv = self.cache.data
        return {**self.target.info(), "kv_cache": str(kv.dtype).replace("torch.", ""),
                "kv_cache_bytes": kv.numel() * kv.element_size(),
                "decode_config": {k: getattr(self.decode_config, k) for k in sorted(option_names(DecodeConfig))},
                **self.states.info()}
