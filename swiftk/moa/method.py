"""method="moa" (experimental): the trained Mixture-of-Attentions drafter as the round's model drafter, beside
the free sources. Registered with swiftk.methods by name; the core never imports this package."""
from __future__ import annotations

from pathlib import Path

from ..target.costs import ema
from ..errors import SwiftkError
from ..home import swiftk_home
from ..methods import Method
from ..proposers.draft_head import target_draft_head
from ..proposers.draft_loop import ModelDrafter
from ..target import Target
from .model import load
from .runner import MoARunner, moa_draft


def trained_drafter_path(target: Target) -> Path:
    """``$SWIFTK_HOME/drafters/<name>-<fingerprint>.safetensors``: where ``swiftk train-drafter`` writes."""
    fp = str(target.identity.get("fingerprint") or "")[:12]
    return swiftk_home() / "drafters" / f"{target.name}-{fp}.safetensors"


def drafter_path(target: Target) -> Path:
    """Where this model's drafter is looked for: the trained one, else the one shipped with the package."""
    home = trained_drafter_path(target)
    shipped = Path(__file__).parent / "drafters" / f"{target.identity.get('name')}.safetensors"
    return home if home.is_file() or not shipped.is_file() else shipped


def load_drafter(target: Target, path=None) -> MoARunner:
    """Load a trained drafter (``path``, default :func:`drafter_path`) as the target's "drafter" resource."""
    p = Path(path) if path is not None else drafter_path(target)
    if path is None and not p.is_file():
        name = target.identity.get("name") or "<model>"
        raise SwiftkError(f"no MoA drafter for {name!r} (looked for {p}); train one with `swiftk train-drafter "
                          f"--model {name}` or pass swiftk.load(..., drafter=PATH)")
    drafter, extra = load(p, target.config, target.identity, target.device)
    runner = MoARunner(drafter, target.model, target.kv_slots)
    runner.info = {"path": str(p), "tli": drafter.cfg.tli, "lsa": drafter.cfg.lsa, "anchor": drafter.cfg.anchor,
                   "parameters": drafter.n_params(),
                   **{k: extra[k] for k in extra if k != "history"}}
    target.set_resource("drafter", runner)
    return runner


class MoA(Method):
    """Free drafts + a small trained drafter on the target's KV cache (experimental)."""
    name = "moa"

    def build(self, target: Target, cfg) -> None:
        if target.resource("drafter") is None:
            load_drafter(target, target.drafter_file)
        target_draft_head(target, cfg.draft_vocab)

    def drafter(self, target: Target, state, cfg, fixed, slot: int = 0):
        first = target.resource("drafter")   # slot 0's; calls on other batch slots keep their state apart
        runner = first if not slot else target.resource(("drafter", slot), first.twin)
        if runner.drafter is not first.drafter:   # a drafter loaded since this slot's twin was made
            runner = first.twin()
            target.set_resource(("drafter", slot), runner)
        return MoADraft(runner, state, target_draft_head(target, cfg.draft_vocab, slot), target.costs)


class MoADraft(ModelDrafter):
    """The MoA drafter behind the model-drafter protocol the round uses."""

    CATCH_UP = 16   # verified positions behind: the prompt's (or a long rest's) catch-up, not a draft's cost

    def __init__(self, runner: MoARunner, state, head, costs):
        super().__init__(state, head)
        self.runner, self.costs = runner, costs
        self.caught_up = False
        self.reads_final = runner.drafter.cfg.anchor
        self.final = None   # the anchor's input: the final-normed hidden state of the row that chose the root
        runner.reset()

    def take_final(self, h) -> None:
        m = self.runner.model
        self.final = None if h is None else m.ops.rmsnorm(h.float(), m.norm, m.cfg.rms_eps)

    def step_cost(self) -> float:
        """Seconds of one drafter step (prior: a fifth of a decode step, the share its LM head reads)."""
        return self.runner.step_s if self.runner.step_s is not None else 0.2 * (self.costs.step or 1.0)

    def observe_cost(self, seconds_per_step: float) -> None:
        if self.caught_up:   # this round also ingested a backlog (a prompt's states): not what a draft step costs
            self.caught_up = False
            return
        self.runner.step_s = ema(self.runner.step_s, seconds_per_step)   # kept with the drafter (engine lifetime)

    def propose(self, dc) -> list:
        if (self.reads_final and self.final is None) or not dc.gate.should_draft():
            return []   # no anchor after a shared pass: the next round alone has one
        self.caught_up = dc.cache.length - self.runner.n > self.CATCH_UP
        head = self._head(dc.tokens)
        return moa_draft(dc.model, dc.cache, self.runner, dc.tokens[:-1], dc.tokens[-1], dc.sampler, dc.gate,
                         self.calibrate, self.step_cost(), max_draft=dc.max_draft, max_spine=dc.max_spine,
                         topk_bins=dc.bins, head=head, rejection=dc.rejection, final=self.final)
