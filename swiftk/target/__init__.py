"""The target: the numerical model every draft is checked against, and what is known of it on this machine.

One :class:`Target` per engine, made at load. Methods, draft sources and drafters take it (never the engine): the
model and its tokenizer (and the prompts it encodes, checked against the context), the context the engine holds,
the measured cost model, and the objects built once for it (draft heads, the draft model, the corpus tables, a
trained drafter) in its resource table. It sits below
``proposers/`` so that every layer that drafts can name its type.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Optional

import torch

from ..errors import SwiftkError
from ..loading.tokenizer import Tokenizer
from ..runtime.config import ModelConfig
from ..runtime.model import KERNEL_MAX_ROWS, Model
from ..runtime.ops import cpu_layers, cpu_linear, describe
from ..runtime.weights import weight_pages
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

    def info(self) -> dict:
        """What runs: the model, its arithmetic and weights, the kernels, the cost model, the drafters loaded."""
        m, dt = self.model, str(self.dtype).replace("torch.", "")
        fused = m.fused_ok and cpu_layers.fused_active()
        return {"model": self.identity, "config": self.config.to_dict(), "device": str(self.device), "dtype": dt,
                "weights": m.weights, "activations": m.activations or dt, "arithmetic": m.arithmetic(),
                "parameters": m.n_params(), "weight_bytes": m.weight_bytes(),
                "resident_weight_bytes": m.resident_bytes(),
                "weight_pages": weight_pages(m), "weight_formats": m.formats(), "max_context": self.max_context,
                "backends": describe(self.device),
                "linear": cpu_linear.status() if self.device.type == "cpu" else "torch matmul",
                "layer_loop": (f"fused C loop (kernels/cpu/cpu_decode.cpp), passes of <= {KERNEL_MAX_ROWS} tokens "
                               "(longer causal prefills in passes of that size)" if fused else "torch, op by op"),
                "costs": self.costs.to_dict(), "drafter": getattr(self.resource("drafter"), "info", None),
                "draft_model": getattr(self.resource("draft_model"), "info", None),
                "cuda_graphs": m.graphs.info() if m.graphs is not None else None}

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, prompt, chat: bool = False, tools: Optional[list] = None) -> list:
        """Token ids of a prompt: ids as given, a text, or (``chat``) messages in the chat template, which shows
        the model ``tools`` (OpenAI's tool specs) when given. Checked here: ids in the vocabulary, a text not
        longer than any tokenization of the context could be."""
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

    def check_sequence(self, token_ids) -> list:
        """``token_ids`` as a list, refused unless non-empty ids of the vocabulary that fit the context."""
        ids, V = list(token_ids), self.config.vocab_size
        if not ids:
            raise SwiftkError("token_ids is empty")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise SwiftkError(f"token id {bad[0]!r} is not an int in [0, {V})")
        if len(ids) > self.max_context:
            raise SwiftkError(f"{len(ids)} tokens exceed the context ({self.max_context})")
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
