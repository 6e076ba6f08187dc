"""Structured outputs: swiftk's JSON-Schema-constrained chat answers against its own unconstrained decoding.

    python -m bench.structured --model smollm2-135m --reps 3 --max-new-tokens 160

Arms, alternated in order every repetition: ``ar`` (plain decoding, no grammar), ``ar-schema`` (plain constrained
decoding), ``default`` (the default ``generate``, no grammar) and ``default-schema`` (the default with the schema:
free drafts plus the grammar's forced tokens). The plain arms run on an engine of their own. Wall times include
the prefill; per prompt and arm the median of the repetitions, then tokens / seconds over all prompts. Every
``default-schema`` answer must equal ``ar-schema``'s tokens (the run fails otherwise) and parse as JSON. Writes
bench/results/structured_<model>_<date>.md and .json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchlib.results import write_result

# bounded, as real schemas are: a 135M model otherwise fills strings and numbers until the token limit
S, B = {"type": "string", "maxLength": 48}, {"type": "boolean"}
I = {"type": "integer", "minimum": 0, "maximum": 100000}


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _list(item: dict, n: int = 3) -> dict:
    return {"type": "array", "items": item, "maxItems": n}


CASES = [
    ("Describe a software engineer named Priya as JSON.",
     _obj({"name": S, "age": I, "title": S, "email": S, "remote": B, "skills": _list(S)})),
    ("Give a product listing for a waterproof hiking backpack as JSON.",
     _obj({"product_id": S, "name": S, "price_cents": I, "in_stock": B, "colors": _list(S),
           "dimensions": _obj({"height_cm": I, "width_cm": I, "depth_cm": I})})),
    ("Return an order with two line items for a coffee shop as JSON.",
     _obj({"order_id": S, "customer": S, "items": _list(_obj({"sku": S, "quantity": I, "unit_price": I}), 2),
           "paid": B, "notes": S})),
    ("Describe a conference talk about databases as a JSON record.",
     _obj({"title": S, "speaker": _obj({"name": S, "company": S}), "duration_minutes": I, "room": S,
           "tags": _list(S), "recorded": B})),
    ("List two classic novels as JSON with their authors and years.",
     _obj({"books": _list(_obj({"title": S, "author": S, "year": I}), 2)})),
    ("Write a web server configuration as JSON.",
     _obj({"host": S, "port": I, "tls": B, "workers": I, "log_level": {"enum": ["debug", "info", "warning", "error"]},
           "allowed_origins": _list(S, 2)})),
]
ARMS = ("ar", "ar-schema", "default", "default-schema")


def main(argv=None) -> int:
    import torch

    import swiftk
    from benchlib.machine import machine_info

    ap = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    ar_eng = swiftk.load(a.model, persist=False)
    eng = swiftk.load(a.model, persist=False)
    grammars = [swiftk.Grammar.json_schema(schema) for _, schema in CASES]
    msgs = [[{"role": "user", "content": q}] for q, _ in CASES]
    for e in (ar_eng, eng):   # warm: the grammar engine's tokenizer view, first passes
        e.generate(msgs[0], chat=True, max_new_tokens=8, grammar=grammars[0], method="autoregressive")
    walls = {arm: [[] for _ in CASES] for arm in ARMS}
    tokens = {arm: [0] * len(CASES) for arm in ARMS}
    texts = {}
    for rep in range(a.reps):
        state = eng.new_state()   # each repetition from a fresh learned state, carried prompt to prompt
        order = ARMS if rep % 2 == 0 else ARMS[::-1]
        for i, m in enumerate(msgs):
            for arm in order:
                e = ar_eng if arm.startswith("ar") else eng
                kw = dict(chat=True, max_new_tokens=a.max_new_tokens)
                kw.update(method="autoregressive" if arm.startswith("ar") else None)
                if arm.endswith("schema"):
                    kw["grammar"] = grammars[i]
                if not arm.startswith("ar"):
                    kw["state"] = state
                t = time.perf_counter()
                r = e.generate(m, **kw)
                walls[arm][i].append(time.perf_counter() - t)
                tokens[arm][i] = len(r.token_ids)
                texts[(arm, i)] = r
    for i in range(len(CASES)):
        ref, got = texts[("ar-schema", i)], texts[("default-schema", i)]
        if got.token_ids != ref.token_ids:
            sys.exit(f"case {i}: the default's constrained answer differs from plain constrained decoding")
    parsed = sum(_parses(texts[("ar-schema", i)].text) for i in range(len(CASES)))
    rate = {arm: sum(tokens[arm]) / sum(statistics.median(w) for w in walls[arm]) for arm in ARMS}
    forced = sum(texts[("default-schema", i)].stats.accepted_by_source.get("grammar", 0) for i in range(len(CASES)))
    drafted = sum(len(texts[("default-schema", i)].token_ids) - texts[("default-schema", i)].stats.plain_steps
                  for i in range(len(CASES)))
    res = {"model": a.model, "reps": a.reps, "max_new_tokens": a.max_new_tokens, "cases": len(CASES),
           "tokens_per_s": {k: round(v, 1) for k, v in rate.items()}, "tokens": tokens,
           "median_walls_s": {k: [round(statistics.median(w), 4) for w in v] for k, v in walls.items()},
           "grammar_accepted_tokens": forced, "parsed": parsed, "schema_tokens": sum(tokens["default-schema"]),
           "machine": machine_info("cpu", torch.get_num_threads()), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "answers": [texts[("ar-schema", i)].text for i in range(len(CASES))]}
    mi = res["machine"]
    lines = [f"# Structured outputs, {a.model} ({mi['cpu']}, {mi['cpu_arch']}, {mi['threads']} threads, commit "
             f"{(mi['git_commit'] or '?')[:8]}, {res['date']})", "",
             f"{len(CASES)} JSON-Schema chat prompts, {a.max_new_tokens} tokens at most, median of {a.reps} "
             "alternated repetitions per prompt, prefill included.", "",
             "| arm | tok/s | ÷ ar | ÷ ar-schema |", "|---|---:|---:|---:|"]
    for arm in ARMS:
        lines.append(f"| {arm} | {rate[arm]:.1f} | {rate[arm] / rate['ar']:.2f}x | {rate[arm] / rate['ar-schema']:.2f}x |")
    lines += ["", f"default-schema: {forced} of {res['schema_tokens']} tokens accepted from the grammar's forced "
              f"chains; answers token-identical to ar-schema ({len(CASES)}/{len(CASES)}); {parsed}/{len(CASES)} complete "
              "and parse as JSON (the others hit the token limit).",
              f"(drafted-round tokens: {drafted})"]
    md = "\n".join(lines) + "\n"
    print(md)
    write_result(a.out, f"structured_{a.model}", md, res)
    return 0


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
