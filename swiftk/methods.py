"""Decoding methods as objects: each checks its own arguments, declares what it needs, and names the drafter it
decodes with; every method but the reference also takes the free sources (context n-grams, session history,
corpus, user proposers). A method sees the target it drafts for (swiftk.target.Target), never the engine, which
holds no per-method branches: a method is one class here, or one registered
from its own package (``register``; the experimental MoA drafter registers from swiftk.moa).
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from .runtime import skipset
from .errors import SwiftkError
from .proposers.draft_head import target_draft_head
from .proposers.draft_model import DraftModelDraft
from .proposers.layerskip.draft import LayerSkipDraft
from .target import Target


class Method:
    name = ""
    speculative = True     # False: plain decoding, reads and writes no learned state, takes no proposers
    defaults: dict = {}    # decode options whose default this method changes
    takes_skip_set = False
    takes_kvq = False      # kvq reuses a layer-skip draft's lower layers: only a method with one can apply it
    one_at_a_time = False  # its drafter keeps one engine-wide state: a batch decodes one such call at a time

    def fixed_skip(self, n_layers: int, identity: dict, exit_layer, skip_set, optimize: bool):
        """The draft's skip set when this call fixes it, else None; a SwiftkError for arguments it does not take."""
        if exit_layer is not None:
            raise SwiftkError(f"exit_layer is an option of method='early_exit', not {self.name!r}")
        if skip_set is None:
            return None
        if not self.takes_skip_set:
            raise SwiftkError(f"skip_set is an option of the layer-skip methods, not {self.name!r}")
        if optimize:
            raise SwiftkError("skip_set=... decodes with that set without optimizing; to keep optimizing from it "
                              "use engine.states.load_skip_set(path, optimize=True)")
        return skipset.coerce(skip_set, n_layers, identity)

    def state_key(self, fixed) -> Optional[object]:
        """Which learned state the call uses: None for the engine's own (SWIFT's), else a key of its own (a fixed
        draft learns its own calibration)."""
        return self.name if fixed is None else bytes(fixed.cpu().to(torch.uint8).tolist())

    def prepare(self, target: Target, cfg) -> None:
        """Check the decode options against the method, then build what it needs before the timed loop."""
        if cfg.kvq and not self.takes_kvq:
            raise SwiftkError(f"kvq is an option of the layer-skip methods (swift, static, early_exit), "
                              f"not {self.name!r}")
        self.build(target, cfg)

    def build(self, target: Target, cfg) -> None:
        """What the method builds once, before the timed loop (draft head, trained drafter, its own checks)."""

    def drafter(self, target: Target, state, cfg, fixed, slot: int = 0):
        """The model drafter for one call on batch slot ``slot`` (proposers.layerskip.LayerSkipDraft or alike), or
        None."""
        return None


class Autoregressive(Method):
    """Plain decoding, one target pass per token (the reference)."""
    name, speculative = "autoregressive", False


class LayerSkip(Method):
    """SWIFT: the layer-skip draft with the learned, searched skip set (or a given one), plus the free sources."""
    name, takes_skip_set, takes_kvq = "swift", True, True

    def state_key(self, fixed):
        return None if fixed is None else super().state_key(fixed)

    def build(self, target: Target, cfg) -> None:
        target_draft_head(target, cfg.draft_vocab)   # its token ranking takes ~2 s once per machine: not in the loop

    def drafter(self, target: Target, state, cfg, fixed, slot: int = 0):
        return LayerSkipDraft(state, target.costs, fixed, search=cfg.optimize,
                              head=target_draft_head(target, cfg.draft_vocab, slot), kvq=cfg.kvq)


class Static(LayerSkip):
    """Free drafts + layer-skip draft with a fixed skip_set (Self-SD, `swiftk optimize`)."""
    name = "static"

    def fixed_skip(self, n_layers, identity, exit_layer, skip_set, optimize):
        if skip_set is None and exit_layer is None:
            raise SwiftkError("method='static' needs skip_set=PATH (a file from save_skip_set or swiftk optimize)")
        return super().fixed_skip(n_layers, identity, exit_layer, skip_set, optimize)


class EarlyExit(LayerSkip):
    """Free drafts + draft from layers 0..exit_layer-1, then the LM head (LayerSkip, KVQ cache)."""
    name = "early_exit"
    defaults = {"kvq": True}   # the exit boundary sits mid-model: reusing the layers below it pays (bench.kvq)

    def fixed_skip(self, n_layers, identity, exit_layer, skip_set, optimize):
        if exit_layer is None:
            raise SwiftkError("method='early_exit' needs exit_layer=E (the draft runs layers 0..E-1)")
        if skip_set is not None:
            raise SwiftkError("method='early_exit' takes exit_layer, not skip_set")
        return skipset.early_exit(n_layers, exit_layer)


class DraftModel(Method):
    """Free drafts + a smaller model of the same family as the drafter (``swiftk.load(..., draft_model=NAME)``);
    the default method of an engine loaded with one."""
    name, one_at_a_time = "draft_model", True

    def build(self, target: Target, cfg) -> None:
        runner = target.resource("draft_model")
        if runner is None:
            raise SwiftkError("method='draft_model' needs a draft model: swiftk.load(MODEL, draft_model=NAME_OR_PATH)")
        if cfg.draft_vocab != runner.info["draft_vocab"]:
            raise SwiftkError("draft_vocab of a draft model is set at load: swiftk.load(..., draft_vocab=N)")

    def drafter(self, target: Target, state, cfg, fixed, slot: int = 0):
        runner = target.resource("draft_model")
        if not cfg.prefix_cache:   # no reuse across calls asked for (history_scope="key"): the draft's cache too
            runner.forget()
        return DraftModelDraft(runner, state, target.costs)


class FreeOnly(Method):
    """Free drafts only: context n-grams, session history, corpus (no model drafter)."""
    name = "ngram"


_METHODS: dict = {}
_LAZY = {"moa": "swiftk.moa.method:MoA"}   # experimental: imported at first use, the core never imports it


def register(method: Method) -> Method:
    _METHODS[method.name] = method
    return method


for _m in (LayerSkip(), Autoregressive(), EarlyExit(), Static(), DraftModel(), FreeOnly()):
    register(_m)


def names() -> tuple:
    return tuple(_METHODS) + tuple(n for n in _LAZY if n not in _METHODS)


def get(name) -> Method:
    if isinstance(name, str) and name not in _METHODS and name in _LAZY:
        mod, cls = _LAZY[name].split(":")
        register(getattr(importlib.import_module(mod), cls)())
    m = _METHODS.get(name) if isinstance(name, str) else None
    if m is None:
        raise SwiftkError(f"unknown method {name!r}; use one of {', '.join(names())}")
    return m
