"""The target: the numerical model every draft is checked against, and what is known of it on this machine.

One :class:`Target` per engine, made at load. Methods, draft sources and drafters take it (never the engine): the
model and its tokenizer, the context the engine holds, the measured cost model, and the objects built once for it
(draft heads, the draft model, the corpus tables, a trained drafter) in its resource table. It sits below
``proposers/`` so that every layer that drafts can name its type.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Optional

import torch

from ..loading.tokenizer import Tokenizer
from ..runtime.config import ModelConfig
from ..runtime.model import Model
from .costs import CostModel


class Target:
    def __init__(self, model: Model, tokenizer: Tokenizer, identity: dict, max_context: int, kv_slots: int,
                 costs: CostModel, drafter_file: Optional[str] = None):
        """``kv_slots``: the slots of each KV cache the engine makes (the context plus the scratch for drafts and
        verify trees); a drafter that keeps a cache of its own sizes it so. ``drafter_file``: the trained drafter
        named at load (``method="moa"``), or None to look for one by the model's name."""
        self.model, self.tokenizer, self.costs = model, tokenizer, costs
        self.config: ModelConfig = model.cfg
        self.identity = dict(identity)
        self.max_context, self.kv_slots, self.drafter_file = max_context, kv_slots, drafter_file
        self._resources: dict = {}
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def name(self) -> str:
        """The model's name (for file names and messages): the registry's, else "model"."""
        return str(self.identity.get("name") or "model")

    def resource(self, key: Hashable, make: Optional[Callable[[], Any]] = None) -> Any:
        """An object built once per target (draft head, corpus tables, trained drafter): ``make()`` at first use;
        None when it was never made and ``make`` is None."""
        if key not in self._resources and make is not None:
            value = make()   # outside the lock: a build may take seconds and read other resources
            with self._lock:
                self._resources.setdefault(key, value)
        return self._resources.get(key)

    def set_resource(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._resources[key] = value
