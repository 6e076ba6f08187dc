"""Skip sets: encoding, validation and files.

A skip set is a bool tensor ``[2 * n_layers]``: entry ``2*i`` skips layer i's attention, ``2*i + 1`` its MLP.
The first and the last layer are never skipped (the draft must start from the embeddings the target sees and end
in the representation the LM head expects); :func:`eligible` is the one place that rule lives.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..atomic import write_json_atomic
from ..errors import SwiftkError
from ..files import read_json


def eligible(n_layers: int) -> range:
    """Sublayer indices a skip set may contain (every sublayer but those of the first and last layer)."""
    return range(2, 2 * n_layers - 2)


def to_layers(skip: torch.Tensor) -> dict:
    s = skip.tolist()
    return {"attention": [i // 2 for i in range(0, len(s), 2) if s[i]],
            "mlp": [i // 2 for i in range(1, len(s), 2) if s[i]]}


def from_layers(n_layers: int, attention, mlp, where: str = "skip set") -> torch.Tensor:
    """bool [2L] from lists of layer indices whose attention / MLP sublayer the draft skips."""
    s = torch.zeros(2 * n_layers, dtype=torch.bool)
    ok = eligible(n_layers)
    for key, layers, off in (("attention", attention, 0), ("mlp", mlp, 1)):
        if not isinstance(layers, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                            for x in layers):
            raise SwiftkError(f"{where}: {key!r} must be a list of layer indices, got {layers!r}")
        for layer in layers:
            if 2 * layer + off not in ok:
                raise SwiftkError(f"{where}: layer {layer} cannot be skipped (first/last or out of range "
                                  f"0..{n_layers - 1})")
            s[2 * layer + off] = True
    return s


def check(skip, n_layers: int, where: str = "skip_set") -> torch.Tensor:
    n = 2 * n_layers
    if not isinstance(skip, torch.Tensor) or skip.dtype != torch.bool or tuple(skip.shape) != (n,):
        got = f"{skip.dtype} {tuple(skip.shape)}" if isinstance(skip, torch.Tensor) else type(skip).__name__
        raise SwiftkError(f"{where} tensor must be bool of shape [{n}] (attention, MLP per layer), got {got}")
    s = skip.cpu()
    bad = [i for i in torch.nonzero(s).flatten().tolist() if i not in eligible(n_layers)]
    if bad:
        raise SwiftkError(f"{where}: sublayer {bad[0]} (layer {bad[0] // 2}) cannot be skipped: the first and last "
                          "layer are always computed")
    return s


def early_exit(n_layers: int, exit_layer) -> torch.Tensor:
    """The early-exit draft as a skip set: every sublayer from ``exit_layer`` on is skipped.

    (The one exception to :func:`eligible`: an early exit skips the last layer too; the final norm and LM head
    still run.)"""
    if not isinstance(exit_layer, int) or isinstance(exit_layer, bool) or not 1 <= exit_layer < n_layers:
        raise SwiftkError(f"exit_layer must be an int in [1, {n_layers - 1}] for this {n_layers}-layer model, "
                          f"got {exit_layer!r}")
    s = torch.zeros(2 * n_layers, dtype=torch.bool)
    s[2 * exit_layer:] = True
    return s


def kvq_boundary(skip: torch.Tensor) -> int:
    """First layer with a skipped sublayer: below it the draft computes exactly what the target computes."""
    idx = torch.nonzero(skip.cpu()).flatten()
    return int(idx[0]) // 2 if idx.numel() else skip.shape[0] // 2


SUBLAYERS = ("attention", "mlp")
NOTES = ("matchness", "source", "objective")   # what a search may note beside the set (save's ``extra``)


def _refuse_unknown(keys, known, where: str) -> None:
    unknown = sorted(set(keys) - set(known))
    if unknown:   # a misspelt key would otherwise skip nothing, silently
        raise SwiftkError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (known: {', '.join(known)})")


def save(path: Union[str, os.PathLike], skip: torch.Tensor, identity: dict, **extra) -> None:
    """JSON tagged with the model identity; ``extra`` fields (a search's numbers: one of NOTES) stored alongside."""
    _refuse_unknown(extra, NOTES, "save_skip_set")
    write_json_atomic(path, {"model": identity, "n_layers": skip.shape[0] // 2, **to_layers(skip), **extra})


def read(path: Union[str, os.PathLike], identity: dict, n_layers: int) -> torch.Tensor:
    """Parse a skip-set file written by :func:`save` (``save_skip_set``, ``swiftk optimize``) for this model."""
    data = read_json(path, "skip set file", max_bytes=1 << 20)
    _refuse_unknown(data, ("model", "n_layers") + SUBLAYERS + NOTES, f"skip set file {path}")
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    if data.get("n_layers") != n_layers or model.get("name") != identity.get("name"):
        raise SwiftkError(f"skip set in {path} is for model {model.get('name')!r} with {data.get('n_layers')} "
                          f"layers, not {identity.get('name')!r} with {n_layers}")
    return from_layers(n_layers, data.get("attention", []), data.get("mlp", []), where=f"skip set in {path}")


def coerce(value, n_layers: int, identity: dict) -> torch.Tensor:
    """A user's skip_set argument (file path, dict of layer lists, bool tensor) as a validated bool tensor."""
    if isinstance(value, torch.Tensor):
        return check(value, n_layers)
    if isinstance(value, dict):
        _refuse_unknown(value, SUBLAYERS, "skip_set")
        return from_layers(n_layers, value.get("attention", []), value.get("mlp", []))
    if isinstance(value, (str, os.PathLike)):
        return read(value, identity, n_layers)
    raise SwiftkError(f"skip_set must be a file path, a dict of layer lists or a bool tensor, "
                      f"got {type(value).__name__}")


@dataclass(frozen=True, eq=False)
class SkipSet:
    """One skip set as the decode loop uses it, derived once: the host mask, its flags (the torch path branches on
    them), the device copy the kernels read, the share of a decode step's weight bytes a draft step with it reads,
    and its KVQ boundary (the first layer with a skipped sublayer; None when nothing below it can be reused)."""

    mask: torch.Tensor
    flags: tuple
    device_mask: torch.Tensor
    kept: float
    boundary: Optional[int]

    @staticmethod
    def of(mask: torch.Tensor, device, kept: float) -> "SkipSet":
        host = mask.cpu()
        return SkipSet(host, tuple(host.tolist()), mask.to(device), kept, kvq_boundary(host) or None)
