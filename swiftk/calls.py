"""From a user's arguments to a call's result, for the engine: the checked :class:`~swiftk.requests.Request`,
the call opened on a batch slot (its KV cache, learned state, sink, Session and Decoder), and its result. A mixin
of Engine (engine.py keeps the lock, the learned states, persistence and the public calls)."""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence

from . import methods
from .decoding.costs import Gate
from .decoding.grammar import Grammar, ll_tokenizer
from .decoding.loop import Decoder
from .decoding.output import GenerationResult, TokenLogprobs, TokenSink, check_lengths, progress_bar, rate
from .decoding.prefix import may_reuse
from .decoding.sampler import Sampler, SamplingParams
from .decoding.session import Session
from .decoding.state import LearnedState
from .errors import SwiftkError
from .options import split_options, updated
from .proposers import FREE, free_sources
from .proposers.user import check_proposers
from .requests import Call, Request, Slot, check_slots_fit, default_max_batch

SCRATCH = 128   # slots past the context for the draft / matchness / verify scratch (context_window <= 120, trees <= 64)


class Calls:
    """Needs from Engine: config, tokenizer, identity, model, costs, state, decode_config, max_context, device,
    _prefix_asked, _slots, cache, corpus(), _state_for(), _save_persisted(), persist, default_method."""

    def encode_prompt(self, prompt, chat: bool = False, tools: Optional[list] = None) -> list:
        """Token ids of a prompt: ids as given, a text, or (``chat``) messages in the chat template, which shows
        the model ``tools`` (OpenAI's tool specs) when given."""
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
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                      **({"tools": tools} if tools else {}))
            self.check_prompt_bytes(text)
            ids = self.tokenizer.encode(text, add_bos=False)
        else:
            if not isinstance(prompt, str):
                raise SwiftkError(f"prompt must be a string, a list of token ids or (chat=True) messages, "
                                  f"got {type(prompt).__name__}")
            self.check_prompt_bytes(prompt)
            ids = self.tokenizer.encode(prompt)
        if not prompt or not ids:
            raise SwiftkError("prompt is empty")
        return ids

    @property
    def prompt_char_limit(self) -> int:
        """No text over this many characters fits the context, whatever it says (each token covers at most the
        vocabulary's longest entry; a character is at least a byte)."""
        return self.max_context * self.tokenizer.max_token_bytes

    def check_prompt_bytes(self, text: str) -> None:
        """Refuse, before tokenizing it, a text too long for the context in any tokenization: a huge input costs
        ~250 MB of tokenizer memory per MB."""
        if len(text) > self.prompt_char_limit:
            n = len(text.encode("utf-8", "surrogatepass"))
            least = -(-n // self.tokenizer.max_token_bytes)
            raise SwiftkError(f"the prompt is {n} bytes: at least {least} tokens (no token of this vocabulary "
                              f"covers more than {self.tokenizer.max_token_bytes} bytes), over the context "
                              f"({self.max_context} tokens)")

    def request(self, prompt, max_new_tokens: int = 128, method: Optional[str] = None, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None, stop: Sequence[str] = (),
                chat: bool = False, callback: Optional[Callable[[str], None]] = None,
                progress: bool = False, exit_layer: Optional[int] = None, skip_set=None,
                state: Optional[LearnedState] = None, proposers: Sequence = (),
                _cancel: Optional[threading.Event] = None, logprobs: Optional[int] = None,
                grammar: Optional[Grammar] = None, **options) -> Request:
        """``generate``'s arguments checked, before any work: what a call (alone or in a batch) decodes from."""
        m = methods.get(self.default_method if method is None else method)
        decode_kw, opt_kw = split_options(options)
        if opt_kw:
            k = sorted(opt_kw)[0]
            raise SwiftkError(f"{', '.join(sorted(opt_kw))}: optimizer option(s) shape the learned state, not one "
                              f"call; use eng.reset_optimizer({k}={opt_kw[k]!r}) or swiftk.load(..., {k}=...)")
        cfg = updated(self.decode_config, {**m.defaults, **decode_kw})
        reuse_ok = may_reuse(cfg.prefix_cache, self._prefix_asked or decode_kw.get("prefix_cache") is True, self.model)
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise SwiftkError(f"stop must be a string or a list of strings, got {stop!r}")
        if not callable(callback) and callback is not None:
            raise SwiftkError("callback must be callable")
        if not isinstance(chat, bool):
            raise SwiftkError(f"chat must be True or False, got {chat!r}")
        if state is not None and not isinstance(state, LearnedState):
            raise SwiftkError(f"state must be a LearnedState (eng.new_state()), got {type(state).__name__}")
        if state is not None and state.n_layers != self.config.n_layers:
            raise SwiftkError(f"state is for a {state.n_layers}-layer model, this one has {self.config.n_layers} layers")
        sp = SamplingParams(temperature, top_k, top_p, seed).validate()
        proposers = check_proposers(proposers, m, not sp.greedy and cfg.sampling == "rejection")
        fixed = m.fixed_skip(self.config.n_layers, self.identity, exit_layer, skip_set,
                             "optimize" in decode_kw and cfg.optimize)
        ids = self.encode_prompt(prompt, chat)
        check_lengths(len(ids), max_new_tokens, self.max_context, self.config.max_position)
        lp = None if logprobs is None else TokenLogprobs(logprobs)
        return Request(ids, max_new_tokens, m, sp, list(stop), cfg, fixed, state, proposers, reuse_ok, exit_layer,
                       callback, progress, _cancel, lp, self._grammar_state(grammar, sp, cfg))

    def _grammar_state(self, grammar, sp, cfg):
        """A call's own state of ``grammar`` (None without one), its tokenizer view built once per engine."""
        if grammar is None:
            return None
        if not isinstance(grammar, Grammar):
            raise SwiftkError(f"grammar must be a swiftk.Grammar (Grammar.json_schema(...), .json_object(), "
                              f".regex(...), .lark(...)), got {type(grammar).__name__}")
        if not sp.greedy and cfg.sampling == "rejection":
            raise SwiftkError("grammar= needs sampling='coupled' (the default): tree rejection sampling draws from "
                              "the draft's distributions, which know no grammar")
        return grammar.matcher(self.resource("ll_tokenizer",
                                             lambda: ll_tokenizer(self.tokenizer, self.config.vocab_size)))

    def open_call(self, req: Request, slot: int, batched: bool = False) -> Call:
        """Start decoding ``req`` on batch slot ``slot`` (its KV cache): the method's drafter and learned state,
        the sink, the Session and its Decoder (None for the reference method alone, which has its own loop)."""
        m, cfg, sp = req.method, req.cfg, req.sampling
        sl = self.slot(slot)
        if m.speculative:
            m.prepare(self, cfg)   # what the method builds once (draft head, drafter), before the timed loop
            if cfg.datastore:
                self.corpus()
        state = req.state if req.state is not None or not m.speculative else self._state_for(m.state_key(req.fixed))
        bar, cb = None, req.callback
        sink = TokenSink(self.tokenizer, req.max_new_tokens, req.stop, None, req.cancel)
        if req.progress:
            bar, cb = progress_bar(req.max_new_tokens, req.callback, lambda: len(sink.ids))
        sink.callback = cb
        sampler = Sampler(sp, self.device, cfg.sampling)
        reuse = sl.held.shared(sl.cache, req.ids) if req.reuse_ok else 0
        sl.held.forget()   # recorded again once this call has finished, if its passes were exact
        call = Call(req, sl, state, sink, sampler, reuse, bar, time.perf_counter())
        # the reference alone keeps its own loop; in a batch, or recording logprobs, it takes plain rounds
        if m.speculative or batched or req.logprobs is not None or req.grammar is not None:
            # free drafts are deterministic: tree rejection sampling has no rule for them
            rejection = not sp.greedy and cfg.sampling == "rejection"
            sources = [] if rejection or not m.speculative else free_sources(self, state, cfg, req.proposers)
            gate_memory = state.gate if m.speculative else LearnedState(self.config.n_layers, self.state.cfg).gate
            s = Session(self.model, sl.cache, self.costs, Gate(self.costs, gate_memory, cfg), sampler, sink, cfg,
                        req.ids, (*FREE, *(x.name for x in sources)), reuse, req.logprobs, req.grammar)
            drafter = m.drafter(self, state, cfg, req.fixed, slot) if m.speculative else None
            call.decoder = Decoder(s, drafter, sources)
        return call

    def close_call(self, call: Call, stats) -> GenerationResult:
        """A finished call's result; its output joins the learned state's history, the slot records what its
        cache holds."""
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
        stats.exit_layer = req.exit_layer
        if self.persist and m.speculative and call.state is self.state:
            self._save_persisted()
        lp = None if req.logprobs is None else req.logprobs.entries[:len(sink.ids)]
        return GenerationResult(text=sink.text, token_ids=list(sink.ids), prompt_ids=req.ids,
                                finish_reason=sink.finish_reason, stats=stats, logprobs=lp)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one batch slot's KV cache."""
        return self.cache.data.numel() * self.cache.data.element_size()

    @property
    def default_max_batch(self) -> int:
        """Calls decoded together when not told (requests.default_max_batch: by cores and available memory)."""
        return default_max_batch(self.slot_bytes)

    def reserve_slots(self, n: int, asked: str) -> None:
        """Refuse, before any work, ``n`` batch slots whose KV caches would not fit in memory (``asked``: what
        asked for them, for the message)."""
        check_slots_fit(max(0, n - len(self._slots)), self.slot_bytes, asked)

    def made_slot(self, i: int) -> Optional[Slot]:
        """Batch slot ``i`` if its KV cache exists, else None (looking allocates nothing)."""
        return self._slots[i] if i < len(self._slots) else None

    def slot(self, i: int) -> Slot:
        """Batch slot ``i``: a KV cache of its own (slot 0's is ``self.cache``), made at first use."""
        while len(self._slots) <= i:
            check_slots_fit(1, self.slot_bytes, f"batch slot {len(self._slots)}")
            try:
                cache = self.model.new_cache(self.max_context + SCRATCH)
            except (RuntimeError, MemoryError) as e:   # the allocator's own refusal, worded for a user
                raise SwiftkError(f"cannot allocate the KV cache of batch slot {len(self._slots)} "
                                  f"({self.slot_bytes / 2**20:.0f} MiB): out of memory ({e})") from None
            self._slots.append(Slot(cache))
        return self._slots[i]
