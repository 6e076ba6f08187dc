"""From a user's arguments to a call's result: :class:`Calls` checks a request once, hands requests to a scheduler
(:meth:`Calls.decode`: the one road of every call, a lone ``generate`` being a batch of one), opens a call on a
batch slot (its KV cache, learned state, sink, Session and Decoder) and closes it into a result. It is what the
scheduler drives (scheduler.CallHost), and it holds the lock that gives one caller at a time the slots' KV caches
and the learned states. The engine builds one and owns it. Methods are objects (methods.py) that see the
:class:`~swiftk.target.Target`, never the engine: no method has a branch here.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Optional, Sequence

from . import methods
from .decoding.gate import Gate
from .decoding.grammar import Grammar, ll_tokenizer
from .decoding.loop import Decoder
from .decoding.output import GenerationResult, TokenLogprobs, TokenSink, check_lengths, progress_bar, rate
from .decoding.prefix import may_reuse
from .sample.sampler import Sampler, SamplingParams
from .decoding.session import Session
from .decoding.state import LearnedState, LearnedStates
from .errors import SwiftkError
from .options import DecodeConfig, split_options, updated
from .proposers import FREE, free_sources
from .proposers.datastore import CorpusTables
from .proposers.user import check_proposers
from .requests import Call, Request, SlotPool, check_max_batch
from .scheduler import Scheduler
from .target import Target


class Calls:
    def __init__(self, target: Target, slots: SlotPool, states: LearnedStates, decode_config: DecodeConfig,
                 prefix_asked: bool, corpus: CorpusTables):
        """``decode_config``: the engine's defaults for every call; ``prefix_asked``: the engine was loaded with
        prefix_cache=True (reuse asked for, not the default's "where exact")."""
        self.target, self.model, self.slots, self.states = target, target.model, slots, states
        self.decode_config, self.prefix_asked, self.corpus = decode_config, prefix_asked, corpus
        self.lock = threading.RLock()
        self._busy, self._owner = False, None   # a caller holds the KV caches (see hold)

    @property
    def default_method(self) -> str:
        """A call's method when none is named: "draft_model" where the target has one, else "swift"."""
        return "draft_model" if self.target.resource("draft_model") is not None else "swift"

    def request(self, prompt, *, max_new_tokens: int = 128, method: Optional[str] = None, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None, stop: Sequence[str] = (),
                chat: bool = False, callback: Optional[Callable[[str], None]] = None,
                progress: bool = False, exit_layer: Optional[int] = None, skip_set=None,
                state: Optional[LearnedState] = None, proposers: Sequence = (),
                _cancel: Optional[threading.Event] = None, logprobs: Optional[int] = None,
                grammar: Optional[Grammar] = None, **options) -> Request:
        """``Engine.generate``'s arguments checked, before any work: what a call (alone or in a batch) decodes
        from."""
        m, cfg_n = methods.get(self.default_method if method is None else method), self.target.config.n_layers
        decode_kw, opt_kw = split_options(options)
        if opt_kw:
            k = sorted(opt_kw)[0]
            raise SwiftkError(f"{', '.join(sorted(opt_kw))}: optimizer option(s) shape the learned state, not one "
                              f"call; use eng.reset_optimizer({k}={opt_kw[k]!r}) or swiftk.load(..., {k}=...)")
        cfg = updated(self.decode_config, {**m.defaults, **decode_kw})
        reuse_ok = may_reuse(cfg.prefix_cache, self.prefix_asked or decode_kw.get("prefix_cache") is True, self.model)
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise SwiftkError(f"stop must be a string or a list of strings, got {stop!r}")
        if not callable(callback) and callback is not None:
            raise SwiftkError("callback must be callable")
        if not isinstance(chat, bool):
            raise SwiftkError(f"chat must be True or False, got {chat!r}")
        if state is not None and not isinstance(state, LearnedState):
            raise SwiftkError(f"state must be a LearnedState (eng.new_state()), got {type(state).__name__}")
        if state is not None and state.n_layers != cfg_n:
            raise SwiftkError(f"state is for a {state.n_layers}-layer model, this one has {cfg_n} layers")
        sp = SamplingParams(temperature, top_k, top_p, seed).validate()
        proposers = check_proposers(proposers, m, not sp.greedy and cfg.sampling == "rejection")
        fixed = m.fixed_skip(cfg_n, self.target.identity, exit_layer, skip_set, "optimize" in decode_kw and cfg.optimize)
        ids = self.target.encode_prompt(prompt, chat)
        check_lengths(len(ids), max_new_tokens, self.target.max_context, self.target.config.max_position)
        lp = None if logprobs is None else TokenLogprobs(logprobs)
        return Request(ids=ids, max_new_tokens=max_new_tokens, method=m, sampling=sp, stop=list(stop), cfg=cfg,
                       fixed=fixed, state=state, proposers=proposers, reuse_ok=reuse_ok, exit_layer=exit_layer,
                       callback=callback, progress=progress, cancel=threading.Event() if _cancel is None else _cancel,
                       logprobs=lp, grammar=self._grammar_state(grammar, sp, cfg))

    def decode(self, reqs: Sequence[Request], max_batch: int) -> list:
        """The results of ``reqs`` (from :meth:`request`), decoded by one scheduler with ``max_batch`` slots. A call
        that fails raises after the others finish (the first such error, unchanged); an interrupt ends every call
        and propagates."""
        check_max_batch(max_batch)
        bad = [r for r in reqs if not isinstance(r, Request)]
        if bad:
            raise SwiftkError(f"decode takes Requests (eng.calls.request(...)), got {type(bad[0]).__name__}")
        out: list = [None] * len(reqs)
        errors: list = []
        with self.hold():
            sched = Scheduler(self, max_batch, whole_prompts=max_batch == 1)
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

    def decode_many(self, prompts: Sequence, max_batch: int, **kw) -> list:
        """Engine.generate_many: every prompt checked before any decodes, KV caches made for the calls there are."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise SwiftkError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        if "callback" in kw or "_cancel" in kw or kw.get("progress"):
            raise SwiftkError("generate_many takes no callback or progress (one call's options); use generate")
        max_batch = check_max_batch(max_batch)
        reqs = [self.request(p, **kw) for p in prompts]
        max_batch = max(1, min(max_batch, len(reqs)))   # KV caches for the calls there are, not for the cap
        self.slots.reserve(max_batch, f"generate_many of {len(reqs)} prompt(s) at max_batch={max_batch}")
        return self.decode(reqs, max_batch)

    @contextlib.contextmanager
    def hold(self):
        """The KV caches and learned states for one caller's rounds: other threads wait; a call from inside them (a
        callback calling back into the engine) would reset a KV cache under it, so it is refused."""
        with self.lock:
            self.refuse_reentry()
            self._busy, self._owner = True, threading.get_ident()
            try:
                yield
            finally:
                self._busy, self._owner = False, None

    def refuse_reentry(self) -> None:
        if self._busy and self._owner == threading.get_ident():
            raise SwiftkError("this engine is decoding: a callback cannot call back into the same engine "
                              "(use another engine, or collect the text and call after generate returns)")

    def _grammar_state(self, grammar, sp, cfg):
        """A call's own state of ``grammar`` (None without one), its tokenizer view built once per target."""
        if grammar is None:
            return None
        if not isinstance(grammar, Grammar):
            raise SwiftkError(f"grammar must be a swiftk.Grammar (Grammar.json_schema(...), .json_object(), "
                              f".regex(...), .lark(...)), got {type(grammar).__name__}")
        if not sp.greedy and cfg.sampling == "rejection":
            raise SwiftkError("grammar= needs sampling='coupled' (the default): tree rejection sampling draws from "
                              "the draft's distributions, which know no grammar")
        t = self.target
        return grammar.matcher(t.resource("ll_tokenizer", lambda: ll_tokenizer(t.tokenizer, t.config.vocab_size)))

    def open_call(self, req: Request, slot: int) -> Call:
        """Start decoding ``req`` on batch slot ``slot`` (its KV cache): the method's drafter and learned state,
        the sink, the Session and its Decoder (the reference method's has no drafter and no sources)."""
        m, cfg, sp, t = req.method, req.cfg, req.sampling, self.target
        sl = self.slots.get(slot)
        if m.speculative:
            m.prepare(t, cfg)   # what the method builds once (draft head, drafter), before the timed loop
            if cfg.datastore:
                self.corpus.get()
        state = req.state if req.state is not None or not m.speculative else self.states.of(m.state_key(req.fixed))
        bar, cb = None, req.callback
        sink = TokenSink(t.tokenizer, req.max_new_tokens, req.stop, None, req.cancel)
        if req.progress:
            bar, cb = progress_bar(req.max_new_tokens, req.callback, lambda: len(sink.ids))
        sink.callback = cb
        sampler = Sampler(sp, self.model.device, cfg.sampling)
        reuse = sl.held.shared(sl.cache, req.ids) if req.reuse_ok else 0
        sl.held.forget()   # recorded again once this call has finished, if its passes were exact
        call = Call(req, sl, state, sink, sampler, reuse, bar, time.perf_counter())
        # free drafts are deterministic: tree rejection sampling has no rule for them
        rejection = not sp.greedy and cfg.sampling == "rejection"
        sources = [] if rejection or not m.speculative else free_sources(state, cfg, t.config.vocab_size,
                                                                           self.corpus.get, req.proposers)
        gate_memory = state.gate if m.speculative else self.states.new(self.states.main.cfg).gate
        s = Session(self.model, sl.cache, t.costs, Gate(t.costs, gate_memory, cfg), sampler, sink, cfg,
                    req.ids, (*FREE, *(x.name for x in sources)), reuse, req.logprobs, req.grammar)
        drafter = m.drafter(t, state, cfg, req.fixed, slot) if m.speculative else None
        call.decoder = Decoder(s, drafter, sources, reference=not m.speculative)
        return call

    def close_call(self, call: Call, stats) -> GenerationResult:
        """A finished call's result; its output joins the learned state's history, the slot records what its
        cache holds, and the engine's main state is saved where it persists."""
        req, sink, m = call.req, call.sink, call.req.method
        wall = time.perf_counter() - call.t0
        if m.speculative:   # every output decoded with a learned state drafts for later prompts (history=)
            call.state.history.add(sink.ids)
            call.state.tokens_seen += len(sink.ids)
            call.state.time_decode_s += wall
        stats.method, stats.new_tokens, stats.prompt_tokens = m.name, len(sink.ids), len(req.ids)
        stats.prompt_reused = call.reuse
        if req.reuse_ok:
            call.slot.held.record(call.slot.cache, list(req.ids) + list(sink.ids))
        stats.arithmetic = self.model.arithmetic(short=True)
        stats.wall_time_s, stats.tokens_per_s = wall, rate(len(sink.ids), wall)
        stats.queue_time_s = max(0.0, call.t0 - req.arrival)
        stats.exit_layer = req.exit_layer
        if m.speculative and call.state is self.states.main:
            self.states.save()
        lp = None if req.logprobs is None else req.logprobs.entries[:len(sink.ids)]
        return GenerationResult(text=sink.text, token_ids=list(sink.ids), prompt_ids=req.ids,
                                finish_reason=sink.finish_reason, stats=stats, logprobs=lp)
