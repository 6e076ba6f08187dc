"""The held-out prompts a benchmark decodes (from benchlib.workloads, encoded by the engine under test) and the
comparison of two outputs."""
from __future__ import annotations

from swiftk.errors import SwiftkError

WORKLOAD_NAMES = ("humaneval", "mtbench", "domain_shift", "edit", "chat", "multiturn")


def first_diff(a, b):
    """Index of the first differing token, or None when equal (a prefix of different length differs at its end)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def build_prompts(eng, workloads, n_humaneval: int, n_mtbench: int, max_new_tokens: int = 128, skip: int = 0,
                  skip_mtbench: int = 0) -> dict:
    """workload -> list of {id, category, text, chat, ids}. HumanEval is raw completion; the others go through the
    chat template. ``multiturn`` decodes each MT-Bench turn-1 answer first (greedy, ``max_new_tokens``, swiftk
    autoregressive) and asks turn 2 after it; edit and chat take ``n_humaneval`` items. ``skip`` / ``skip_mtbench``
    pass over the first items (per MT-Bench category): held-out prompts, never used while building the method."""
    from benchlib import workloads as W

    out = {}
    for w in workloads:
        if w == "humaneval":
            items = W.humaneval(n_humaneval + skip)[skip:]
        elif w in ("mtbench", "multiturn"):
            items, seen = [], {}   # seen: category -> its questions passed so far
            for it in W.mtbench(n_mtbench + skip_mtbench):
                seen[it["category"]] = seen.get(it["category"], 0) + 1
                if seen[it["category"]] > skip_mtbench:
                    items.append(it)
        elif w == "domain_shift":
            if skip or skip_mtbench:
                raise SwiftkError("domain_shift has no held-out selection: run it without skip / skip_mtbench")
            items = W.domain_shift_stream(n_mtbench, n_humaneval)
        elif w in ("edit", "chat"):
            items = W.WORKLOADS[w](n_humaneval + skip)[skip:]
        else:
            raise SwiftkError(f"unknown workload {w!r}; use {', '.join(WORKLOAD_NAMES)}")
        rows = []
        for it in items:
            chat = it["category"] != "humaneval"
            text = it["turns"][0]
            if w == "multiturn":
                first = eng.generate(text, chat=True, method="autoregressive", max_new_tokens=max_new_tokens).text
                text = W.multiturn_messages(it, first)
            rows.append({"id": it["id"], "category": it["category"], "text": text, "chat": chat,
                         "ids": eng.encode_prompt(text, chat=chat)})
        out[w] = rows
    return out
