"""The decode and optimizer options: validated, frozen dataclasses that every layer reads (the engine merges a
call's keywords into them, the round and the draft sources read them). Kept apart from the model's config
(runtime/config.py), at the bottom of the package, since they depend on nothing but the error type."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Optional

from .errors import SwiftkError

# ---------------------------------------------------------------------------------------------- decoding options
# Two concerns, two dataclasses. OptimizerConfig shapes the learned state (the skip-set search), so it is fixed
# when the state is made: ``swiftk.load(..., skip_ratio=0.3)`` or ``eng.reset_optimizer(skip_ratio=0.3)``.
# DecodeConfig is per round and may change on every call: ``eng.generate(p, max_draft=8)``.
# Every limit is written once, in the field's metadata, and checked by ``_validate``. Fields marked ``advanced``
# are research knobs (the paper's rules, the search's internals): accepted like the others, documented apart
# (docs/options.md), left out of the README's everyday tables.

def _opt(default, kind, lo=None, hi=None, choices=None, lo_open=False, help="", advanced=False):
    return field(default=default, metadata={"kind": kind, "lo": lo, "hi": hi, "choices": choices,
                                            "lo_open": lo_open, "help": help, "advanced": advanced})


def _validate(obj) -> None:
    for f in fields(obj):
        v, m = getattr(obj, f.name), f.metadata
        kind = m.get("kind")
        if kind is None:
            continue
        if kind is bool:
            ok = isinstance(v, bool)
        elif kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif kind is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        elif kind is str:
            ok = isinstance(v, str) and v in m["choices"]
        else:  # top-k bins
            ok = _valid_bins(v)
        if ok and kind in (int, float):
            lo, hi = m["lo"], m["hi"]
            ok = (lo is None or (v > lo if m["lo_open"] else v >= lo)) and (hi is None or v <= hi)
        if not ok:
            rng = m["choices"] and f"one of {', '.join(m['choices'])}" or _range_text(m)
            raise SwiftkError(f"{f.name} must be {rng}, got {v!r}")


def _range_text(m) -> str:
    kind = {bool: "a bool (True/False)", int: "an int", float: "a number"}.get(m["kind"], "(threshold, k>=1) pairs")
    lo, hi = m["lo"], m["hi"]
    if lo is not None and hi is not None:
        return f"{kind} in {'(' if m['lo_open'] else '['}{lo}, {hi}]"
    if lo is not None:
        return f"{kind} {'>' if m['lo_open'] else '>='} {lo}"
    return kind


def _bins_tuple(v):
    """Bins given as lists, as tuples (hashable, comparable); anything else unchanged, for _validate to name."""
    if isinstance(v, (list, tuple)) and all(isinstance(b, (list, tuple)) for b in v):
        return tuple(tuple(b) for b in v)
    return v


def _valid_bins(bins) -> bool:
    try:
        return bool(bins) and all(0.0 <= float(t) <= 1.0 and isinstance(k, int) and k >= 1 for t, k in bins)
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class OptimizerConfig:
    """The on-the-fly skip-set search (SWIFT section 4.1, with a speed objective; see proposers/layerskip/search.py)."""

    skip_ratio: float = _opt(0.45, float, 0.0, 0.95, lo_open=True,
                             help="objective=matchness: fraction of sublayers skipped (paper r); speed: the most")
    context_window: int = _opt(32, int, 4, 120, help="generated tokens a candidate's matchness is measured on", advanced=True)
    bayes_interval: int = _opt(25, int, 0, help="a Bayesian-optimization suggestion every this many steps (0: off)", advanced=True)
    max_opt_steps: int = _opt(1000, int, 0, help="optimization steps at most (the first scores the starting set)",
                              advanced=True)
    patience: int = _opt(300, int, 1, help="stop after this many steps without a better incumbent", advanced=True)
    max_matchness: float = _opt(0.95, float, 0.0, 1.0, lo_open=True, help="... or once the incumbent's exceeds this "
                                "(objective=speed: an incumbent of the most sublayers allowed)", advanced=True)
    give_up: int = _opt(50, int, 1, help="objective=speed: stop after this many steps when no set found is expected "
                        "to beat plain decoding by 5%, or after the first candidates when the best accepts under a "
                        "quarter of what would pay (>= max_opt_steps: neither)", advanced=True)
    objective: str = _opt("speed", str, choices=("speed", "matchness"),
                          help="speed: expected tokens/s from matchness and measured draft cost; matchness: paper", advanced=True)
    rescore: int = _opt(3, int, 1, 16, help="windows a challenger is scored on before it replaces the incumbent", advanced=True)
    opt_budget: float = _opt(0.05, float, 0.0, 1.0, help="optimization's largest share of decode wall time")
    call_budget: float = _opt(0.01, float, 0.0, 1.0, help="speculate='auto': a search step runs only while the call "
                              "stays within this share of plain decoding's time (it spends what drafts saved first)",
                              advanced=True)
    bo_mode: str = _opt("thread", str, choices=("thread", "sync"),
                        help="thread: GP suggestions off the decode loop; sync: inline (tests)", advanced=True)
    opt_seed: int = _opt(0, int, 0, 2**63 - 1, advanced=True)

    def validate(self) -> "OptimizerConfig":
        _validate(self)
        return self


GREEDY_TOPK = ((0.95, 3), (0.8, 5), (0.5, 8), (0.0, 10))    # candidates per depth by the draft's top-1 probability
SAMPLING_TOPK = ((0.95, 1), (0.8, 3), (0.5, 5), (0.0, 10))


@dataclass(frozen=True)
class DecodeConfig:
    """Per-round knobs of the speculative loop (swift.py); any of them may be given per call."""

    max_draft: int = _opt(25, int, 1, 64, help="max draft depth per round")
    eps: float = _opt(0.8, float, 0.0, 1.0, help="speculate='always': stop drafting below this top-1 probability", advanced=True)
    max_tree_nodes: int = _opt(0, int, 0, 64, help="verify budget; 0 = from the measured cost model")
    topk_greedy: tuple = _opt(GREEDY_TOPK, "bins", help="candidates per depth for greedy decoding", advanced=True)
    topk_sampling: tuple = _opt(SAMPLING_TOPK, "bins", help="... for sampling", advanced=True)
    optimize: bool = _opt(True, bool, help="False: keep the current skip set")
    kvq: bool = _opt(False, bool, help="reuse the draft's exact KV/residual below the first skipped layer")
    speculate: str = _opt("auto", str, choices=("auto", "always"),
                          help="auto: draft only when the cost model expects it to pay; always: every round (paper)")
    ngram: bool = _opt(True, bool, help="add the continuations of the context's tail where it occurred earlier in "
                       "the context (prompt lookup at any match length, suffix.SuffixIndex) to the tree")
    history: bool = _opt(True, bool, help="add the continuations of the context's tail in this state's earlier "
                         "outputs (suffix.OutputHistory: what the model generated for earlier prompts) to the tree")
    recycle: bool = _opt(True, bool, help="add Token Recycling candidates (the target's own top-k after each token "
                         "the last time it read it, proposers/recycle.py) to the tree")
    datastore: bool = _opt(True, bool, help="add corpus n-gram candidates (tables over the Python stdlib's source, "
                           "swiftk/proposers/datastore.py) to the tree where the context has nothing better")
    draft_vocab: int = _opt(8192, int, 0, help="draft logits over this many frequent tokens plus every token of "
                            "the context (proposers.draft_head.DraftHead); 0: the full LM head")
    prefix_cache: bool = _opt(True, bool, help="reuse the KV cache the engine's previous call left for the part of "
                              "the prompt it shares (a chat's earlier turns): exact, only the rest is prefilled; "
                              "False: prefill the whole prompt (benchmarks of fresh prompts)")
    trace: bool = _opt(False, bool, help="keep per-round lists in the stats (accept lengths, tree sizes, phases, "
                       "expected vs measured rates, the search's matchness) for debugging and plots")
    sampling: str = _opt("coupled", str, choices=("coupled", "rejection"),
                         help="coupled: seeded output independent of the draft; rejection: tree speculative sampling")

    def validate(self) -> "DecodeConfig":
        _validate(self)
        if self.max_tree_nodes == 1:
            raise SwiftkError("max_tree_nodes must be 0 (auto) or an int in [2, 64], got 1")
        return self


def option_names(cls, advanced: Optional[bool] = None) -> set:
    """Field names of a config class; ``advanced`` True / False: only the research knobs / only the others."""
    return {f.name for f in fields(cls) if advanced is None or f.metadata.get("advanced", False) == advanced}


def updated(base, kw: dict):
    """``base`` with the fields in ``kw`` replaced, validated (bins given as lists become tuples)."""
    kw = {k: (_bins_tuple(v) if k.startswith("topk_") else v) for k, v in kw.items()}
    try:
        return replace(base, **kw).validate()
    except TypeError as e:
        raise SwiftkError(str(e)) from None


def load_time(draft_model, kw: dict) -> dict:
    """The options taken out of ``kw`` that a load must get rather than a call: with a draft model, draft_vocab
    (it sizes the draft model's head)."""
    return {"draft_vocab": kw.pop("draft_vocab")} if draft_model is not None and "draft_vocab" in kw else {}


def split_options(kw: dict) -> tuple:
    """(decode options, optimizer options); unknown names raise."""
    dec, opt = option_names(DecodeConfig), option_names(OptimizerConfig)
    unknown = set(kw) - dec - opt
    if unknown:
        raise SwiftkError(f"unknown option(s): {', '.join(sorted(unknown))}; decode options: "
                          f"{', '.join(sorted(dec))}; optimizer options: {', '.join(sorted(opt))}")
    return {k: v for k, v in kw.items() if k in dec}, {k: v for k, v in kw.items() if k in opt}
