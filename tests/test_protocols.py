"""The round's contracts: every class the round calls through a Protocol of proposers.base has that Protocol's
members, with the same parameters."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import torch

import swiftk
from swiftk.decoding.gate import Gate
from swiftk.sample.sampler import Sampler, SamplingParams
from swiftk.options import DecodeConfig
from swiftk.proposers.base import DraftGate, Drafter, DraftSampler, FreeSource, Proposer
from swiftk.proposers.draft_loop import ModelDrafter


def protocol_members(proto) -> dict:
    """name -> the Protocol's function (None for an annotated attribute)."""
    out = {n: None for n in getattr(proto, "__annotations__", {})}
    out.update({n: f for n, f in vars(proto).items() if inspect.isfunction(f) and not n.startswith("_")})
    return out


def broken(cls_or_obj, proto) -> list:
    """What ``cls_or_obj`` lacks of ``proto``, or implements with other parameters."""
    bad = []
    for name, f in protocol_members(proto).items():
        if not hasattr(cls_or_obj, name):
            bad.append(f"{name}: missing")
        elif f is not None:
            have = inspect.signature(getattr(cls_or_obj, name))
            want = list(inspect.signature(f).parameters)[1:]   # without self
            params = list(have.parameters)
            params = params[1:] if params[:1] == ["self"] else params
            if params != want:
                bad.append(f"{name}{have}: want ({', '.join(want)})")
    return bad


def all_subclasses(cls) -> set:
    out = set()
    for c in cls.__subclasses__():
        out |= {c} | all_subclasses(c)
    return out


def _import_package() -> None:
    for m in pkgutil.walk_packages(swiftk.__path__, "swiftk."):
        if not m.name.startswith(("swiftk.integrations.vllm", "swiftk.serve", "swiftk.runtime.ops.cuda",
                                  "swiftk.runtime.ops.triton", "swiftk.runtime.graphs")):
            importlib.import_module(m.name)


def test_every_free_source_and_model_drafter_keeps_its_protocol():
    _import_package()
    sources, drafters = all_subclasses(FreeSource) | {FreeSource}, all_subclasses(ModelDrafter)
    assert len(sources) >= 5 and {c.__name__ for c in drafters} >= {"LayerSkipDraft", "DraftModelDraft", "MoADraft"}
    problems = {c.__name__: broken(c, Proposer) for c in sources} | {c.__name__: broken(c, Drafter) for c in drafters}
    assert not {k: v for k, v in problems.items() if v}


def test_the_gate_and_sampler_give_drafts_what_they_read():
    cfg = DecodeConfig().validate()

    class Costs:   # the gate only stores it here
        pass

    gate = Gate(Costs(), None, cfg)
    sampler = Sampler(SamplingParams(temperature=0.7, seed=1), torch.device("cpu"))
    assert broken(gate, DraftGate) == [] and broken(sampler, DraftSampler) == []


def test_the_check_finds_a_missing_or_changed_member():
    class Lacking(ModelDrafter):
        def propose(self, dc, extra):   # one parameter too many
            return []

    found = broken(Lacking, Drafter)   # ModelDrafter leaves step_cost and observe_cost to its subclasses
    assert any(p.startswith("propose") for p in found)
    assert {"step_cost: missing", "observe_cost: missing"} <= set(found)
