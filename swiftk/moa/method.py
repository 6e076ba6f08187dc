"""method="moa" (experimental): the trained Mixture-of-Attentions drafter as the round's model drafter, beside
the free sources. Registered with swiftk.methods by name; the core never imports this package."""
from __future__ import annotations

from pathlib import Path

from ..decoding.costs import ema
from ..errors import SwiftkError
from ..home import swiftk_home
from ..methods import Method
from ..proposers.draft_loop import ModelDrafter
from .model import load
from .runner import MoARunner, moa_draft


def trained_drafter_path(engine) -> Path:
    """``$SWIFTK_HOME/drafters/<name>-<fingerprint>.safetensors``: where ``swiftk train-drafter`` writes."""
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
    """Free drafts + a small trained drafter on the target's KV cache (experimental)."""
    name = "moa"

    def build(self, engine, cfg) -> None:
        if engine.resource("drafter") is None:
            load_drafter(engine, engine.drafter_file)
        engine.draft_head(cfg.draft_vocab)

    def drafter(self, engine, state, cfg, fixed, slot: int = 0):
        first = engine.resource("drafter")   # slot 0's; calls on other batch slots keep their state apart
        runner = first if not slot else engine.resource(("drafter", slot), first.twin)
        if runner.drafter is not first.drafter:   # a drafter loaded since this slot's twin was made
            runner = first.twin()
            engine.set_resource(("drafter", slot), runner)
        return MoADraft(runner, state, engine.draft_head(cfg.draft_vocab, slot), engine.costs)


class MoADraft(ModelDrafter):
    """The MoA drafter behind the model-drafter protocol the round uses."""

    CATCH_UP = 16   # verified positions behind: the prompt's (or a long rest's) catch-up, not a draft's cost

    def __init__(self, runner: MoARunner, state, head, costs):
        super().__init__(state, head)
        self.runner, self.costs = runner, costs
        self.caught_up = False
        runner.reset()

    def step_cost(self) -> float:
        """Seconds of one drafter step (prior: a fifth of a decode step, the share its LM head reads)."""
        return self.runner.step_s if self.runner.step_s is not None else 0.2 * (self.costs.step or 1.0)

    def observe_cost(self, seconds_per_step: float) -> None:
        if self.caught_up:   # this round also ingested a backlog (a prompt's states): not what a draft step costs
            self.caught_up = False
            return
        self.runner.step_s = ema(self.runner.step_s, seconds_per_step)   # kept with the drafter (engine lifetime)

    def propose(self, dc) -> list:
        if not dc.gate.should_draft():
            return []
        self.caught_up = dc.cache.length - self.runner.n > self.CATCH_UP
        head = self._head(dc.tokens)
        return moa_draft(dc.model, dc.cache, self.runner, dc.tokens[:-1], dc.tokens[-1], dc.sampler, dc.gate,
                         self.calibrate, self.step_cost(), max_draft=dc.max_draft, max_spine=dc.max_spine,
                         topk_bins=dc.bins, head=head, rejection=dc.rejection)
