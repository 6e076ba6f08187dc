"""method="moa" (experimental): the trained Mixture-of-Attentions drafter as the round's model drafter, beside
the free sources. Registered with swiftk.methods by name; the core never imports this package."""
from __future__ import annotations

from pathlib import Path

from ..errors import SwiftkError
from ..methods import Method
from ..state import calibration_bin
from .runner import MoARunner, moa_draft


def trained_drafter_path(engine) -> Path:
    """``$SWIFTK_HOME/drafters/<name>-<fingerprint>.safetensors``: where ``swiftk train-drafter`` writes."""
    from ..registry import swiftk_home

    name = str(engine.identity.get("name") or "model")
    fp = str(engine.identity.get("fingerprint") or "")[:12]
    return swiftk_home() / "drafters" / f"{name}-{fp}.safetensors"


def drafter_path(engine) -> Path:
    """Where this model's drafter is looked for: the trained one, else the one shipped with the package."""
    home = trained_drafter_path(engine)
    shipped = Path(__file__).parent / "drafters" / f"{engine.identity.get('name')}.safetensors"
    return home if home.is_file() or not shipped.is_file() else shipped


def load_drafter(engine, path=None) -> MoARunner:
    """Load a trained drafter (``path``, default :func:`drafter_path`) as the engine's "drafter" resource."""
    from .model import load

    p = Path(path) if path is not None else drafter_path(engine)
    if path is None and not p.is_file():
        name = engine.identity.get("name") or "<model>"
        raise SwiftkError(f"no MoA drafter for {name!r} (looked for {p}); train one with `swiftk train-drafter "
                          f"--model {name}` or pass swiftk.load(..., drafter=PATH)")
    drafter, extra = load(p, engine.config, engine.identity, engine.device)
    runner = MoARunner(drafter, engine.model, engine.cache.max_slots)
    runner.info = {"path": str(p), "tli": drafter.cfg.tli, "lsa": drafter.cfg.lsa, "parameters": drafter.n_params(),
                   **{k: extra[k] for k in extra if k != "history"}}
    engine.set_resource("drafter", runner)
    return runner


class MoA(Method):
    name = "moa"
    summary = "free drafts + a small trained drafter on the target's KV cache (experimental)"

    def prepare(self, engine, cfg) -> None:
        if engine.resource("drafter") is None:
            load_drafter(engine, engine.drafter_file)
        engine.draft_head(cfg.draft_vocab)

    def drafter(self, engine, state, cfg, fixed):
        return MoADraft(engine.resource("drafter"), state, engine.draft_head(cfg.draft_vocab), engine.costs)


class MoADraft:
    """The MoA drafter behind the model-drafter protocol the round uses (see proposers/layerskip.py)."""

    name, boundary = "draft", None

    def __init__(self, runner: MoARunner, state, head, costs):
        self.runner, self.state, self.head, self.head_seen, self.costs = runner, state, head, 0, costs
        runner.reset()

    def optimize(self, s) -> str:
        return "accelerate"

    def calibrate(self, p: float) -> float:
        return self.state.calibration.prob(calibration_bin(p))

    def observe(self, p: float, hit: bool) -> None:
        self.state.calibration.observe(calibration_bin(p), hit)

    def step_cost(self) -> float:
        """Seconds of one drafter step (prior: a fifth of a decode step, the share its LM head reads)."""
        return self.runner.step_s if self.runner.step_s is not None else 0.2 * (self.costs.step or 1.0)

    def observe_cost(self, seconds_per_step: float) -> None:
        old = self.runner.step_s   # an EMA, kept with the drafter (engine lifetime)
        self.runner.step_s = seconds_per_step if old is None else old + 0.2 * (min(seconds_per_step, 3 * old) - old)

    def propose(self, s) -> list:
        if not s.gate.should_draft():
            return []
        head = None
        if self.head is not None:
            self.head.add(s.tokens[self.head_seen:-1])
            self.head_seen, head = len(s.tokens) - 1, self.head.logits_full
        return moa_draft(s.model, s.cache, self.runner, s.tokens[:-1], s.tokens[-1], s.sampler, s.gate,
                           self.calibrate, self.step_cost(), max_draft=s.cfg.max_draft, max_spine=s.max_nodes - 1,
                           topk_bins=s.bins, head=head, rejection=s.rejection)

    def finish(self, stats) -> None:
        stats.skip_set = None
