"""Structured outputs as served: `swiftk serve` against native llama.cpp's llama-server on the same GGUF file and
threads, both answering OpenAI's ``response_format: {"type": "json_schema", ...}`` through the official client.

    python -m bench.structured_serve --model smollm2-135m --reps 3

The prompts and schemas are bench/structured.py's. Arms, in alternated order every repetition, each on a fresh server
of its own (started, warmed on a prompt of its own, then the six prompts in turn, then stopped; no two servers run at
once): ``swiftk`` (the default method: free drafts plus the grammar's forced tokens), ``swiftk-free`` (no
response_format: what the schema costs or gains), ``llama`` (``llama-server -fa on -np 1``, which turns the schema
into a GBNF grammar), ``llama-free``. A fresh server per arm and repetition: no answer of an earlier repetition is in
swiftk's learned history, no prompt in llama-server's prompt cache. One client, greedy, non-streamed; a request's
wall time is taken at the client (prefill and HTTP included); tokens are the server's own
``usage.completion_tokens``. Per prompt and arm
the median of the repetitions, then tokens / seconds over all prompts. Every answer of a schema arm is checked to
parse as JSON; swiftk's are also checked against plain constrained decoding in process (token-identical text).
Writes bench/results/structured_serve_<model>_<date>.md and .json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

ARMS = ("swiftk", "swiftk-free", "llama", "llama-free")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.structured_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=3, help="odd: the median is a run")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.reps % 2 == 0:
        raise SystemExit("--reps must be odd")

    import openai
    import torch

    torch.set_num_threads(a.threads)
    import swiftk
    from benchlib.machine import machine_info
    from bench.native_llamacpp import build_info, ensure
    from bench.serve_load import llama_server, swiftk_server
    from benchlib.results import write_result
    from bench.structured import CASES, _parses
    from swiftk.loading.registry import resolve_model

    ensure()
    gguf = resolve_model(a.model)
    eng = swiftk.load(a.model, persist=False)   # the reference: plain constrained decoding, in process
    ref = [eng.generate([{"role": "user", "content": q}], chat=True, max_new_tokens=a.max_tokens,
                        method="autoregressive", grammar=swiftk.Grammar.json_schema(s)).text for q, s in CASES]
    del eng
    walls = {arm: [[] for _ in CASES] for arm in ARMS}
    tokens = {arm: [0] * len(CASES) for arm in ARMS}
    texts: dict = {}
    warm = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for rep in range(a.reps):
        for arm in (ARMS if rep % 2 == 0 else ARMS[::-1]):
            srv = swiftk_server(a.model, a.threads) if arm.startswith("swiftk") else llama_server(gguf, 1, a.threads)
            try:
                c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
                # warm: weights paged in, the grammar engine's first use (a prompt of its own)
                c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Are you ready?"}],
                                          max_tokens=8, temperature=0, response_format=_format(warm))
                for i, (q, schema) in enumerate(CASES):
                    kw = {} if arm.endswith("free") else {"response_format": _format(schema)}
                    t = time.perf_counter()
                    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": q}],
                                                  max_tokens=a.max_tokens, temperature=0, **kw)
                    walls[arm][i].append(time.perf_counter() - t)
                    tokens[arm][i] = r.usage.completion_tokens
                    texts[(arm, i)] = r.choices[0].message.content
            finally:
                srv.stop()
        print(f"rep {rep + 1}/{a.reps} done", file=sys.stderr, flush=True)
    rate = {arm: sum(tokens[arm]) / sum(statistics.median(w) for w in walls[arm]) for arm in ARMS}
    parsed = {arm: sum(_parses(texts[(arm, i)]) for i in range(len(CASES))) for arm in ("swiftk", "llama")}
    equal = sum(texts[("swiftk", i)] == ref[i] for i in range(len(CASES)))
    if equal != len(CASES):
        sys.exit(f"swiftk serve's constrained answers equal plain constrained decoding in {equal}/{len(CASES)}")
    mi = machine_info("cpu", a.threads)
    res = {"model": a.model, "gguf": str(gguf), "reps": a.reps, "max_tokens": a.max_tokens, "cases": len(CASES),
           "tokens_per_s": {k: round(v, 1) for k, v in rate.items()}, "tokens": tokens, "parsed": parsed,
           "median_walls_s": {k: [round(statistics.median(w), 4) for w in v] for k, v in walls.items()},
           "machine": mi, "llamacpp": build_info(gguf, a.threads), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "answers": {arm: [texts[(arm, i)] for i in range(len(CASES))] for arm in ("swiftk", "llama")}}
    lines = [f"# Structured outputs served, {a.model} ({mi['cpu']}, {mi['cpu_arch']}, {a.threads} threads, commit "
             f"{(mi['git_commit'] or '?')[:8]}, {res['date']})", "",
             f"{len(CASES)} JSON-Schema chat prompts (bench/structured.py), {a.max_tokens} tokens at most, one "
             f"client, greedy, a fresh server per arm and repetition, median of {a.reps} alternated repetitions per "
             "prompt, client-side wall time.", "",
             "| arm | tok/s | completion tokens | ÷ llama (schema) |", "|---|---:|---:|---:|"]
    for arm in ARMS:
        lines.append(f"| {arm} | {rate[arm]:.1f} | {sum(tokens[arm])} | {rate[arm] / rate['llama']:.2f}x |")
    lines += ["", f"JSON that parses: swiftk {parsed['swiftk']}/{len(CASES)}, llama-server {parsed['llama']}/"
              f"{len(CASES)} (the rest hit the token limit). swiftk's answers equal plain constrained decoding in "
              f"process: {equal}/{len(CASES)}.",
              f"llama.cpp: {res['llamacpp']['sdist']}, ggml {res['llamacpp'].get('ggml_version')}, build "
              f"{res['llamacpp'].get('build_number', '?')} ({res['llamacpp'].get('build_commit', '?')}), "
              f"{res['llamacpp']['cmake']}."]
    md = "\n".join(lines) + "\n"
    print(md)
    write_result(a.out, f"structured_serve_{a.model}", md, res)
    return 0


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


if __name__ == "__main__":
    raise SystemExit(main())
