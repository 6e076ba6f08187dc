"""MoA drafter ablations (issue 17, like the paper's): TLI 0 / 1, with / without LSA, chain vs dynamic tree.

    python -m bench.moa_ablation --model smollm2-135m --drafter tli0=A.safetensors --drafter tli1=B.safetensors \
        --drafter nolsa=C.safetensors --n 4 --max-new-tokens 128

Each drafter drafts alone (n-gram branches off: on HumanEval they supply nearly every accepted token and would hide
the drafter) and every round drafts (``speculate="always"``: the gate would otherwise stop drafting with a weak
drafter, and there would be nothing to compare). ``tree`` is the default dynamic tree (candidates per depth by the
drafter's confidence, reranked, the verify budget from the cost model), ``chain`` one candidate per depth. Methods
run interleaved prompt by prompt beside swiftk autoregressive, so the ratios share the machine's noise; every output
is checked token-identical to autoregressive. Reports the mean accepted length M (tokens per verify pass, bonus
included), the acceptance rate alpha (accepted / drafted), the drafter step's cost and tok/s relative to AR.
Writes ``bench/results/moa-ablation_<model>_<date>.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from swiftk.atomic import write_atomic
from swiftk.errors import SwiftkError
from swiftk.moa.method import drafter_path, load_drafter  # noqa: F401

SHAPES = {"tree": {}, "chain": {"topk_greedy": ((0.0, 1),)}}


def main(argv=None) -> int:
    from benchlib.machine import device_kind, set_threads
    from benchlib.prompts import build_prompts
    from bench.e2e import _swiftk_run
    import swiftk

    ap = argparse.ArgumentParser(prog="python -m bench.moa_ablation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", action="append", required=True, metavar="LABEL=PATH")
    ap.add_argument("--n", type=int, default=4, help="HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    try:
        drafters = {}
        for s in a.drafter:
            label, sep, path = s.partition("=")
            if not sep or not label or not Path(path).is_file():
                raise SwiftkError(f"--drafter {s!r}: want LABEL=PATH of an existing file")
            drafters[label] = path
        if a.n < 1 or a.max_new_tokens < 1:
            raise SwiftkError("--n and --max-new-tokens must be >= 1")
        threads = set_threads(0)
        eng = swiftk.load(a.model, persist=False, trace=True)   # per-round lists: rounds, tokens emitted
        items = build_prompts(eng, ["humaneval"], a.n, 1)["humaneval"]
    except SwiftkError as e:
        print(f"bench.moa_ablation: error: {e}", file=sys.stderr)
        return 2

    configs = [(lb, sh) for lb in drafters for sh in SHAPES]
    info = {}
    for lb, path in drafters.items():   # warm-up, and each drafter's description
        load_drafter(eng.target, path)
        _swiftk_run(eng, items[0]["ids"], 8, method="moa", ngram=False, history=False, datastore=False,
                    speculate="always")
        d = eng.info()["drafter"]
        info[lb] = {"path": path, "tli": d["tli"], "lsa": d["lsa"], "parameters": d["parameters"],
                    "held_out": d.get("held_out"), "train_s": d.get("train_s")}
    _swiftk_run(eng, items[0]["ids"], 8)
    tot = {k: {"tokens": 0, "wall": 0.0, "accepted": 0, "drafted": 0, "rounds": 0, "draft_s": 0.0, "mismatch": 0,
                "emitted": 0}
           for k in ["ar"] + configs}
    for i, it in enumerate(items):
        ref = _swiftk_run(eng, it["ids"], a.max_new_tokens)
        order = configs if i % 2 == 0 else configs[::-1]
        runs = {"ar": ref}
        for lb, sh in order:
            if eng.info()["drafter"]["path"] != drafters[lb]:
                load_drafter(eng.target, drafters[lb])
            runs[(lb, sh)] = _swiftk_run(eng, it["ids"], a.max_new_tokens, method="moa", ngram=False,
                                         history=False, datastore=False, speculate="always", **SHAPES[sh])
        for k, r in runs.items():
            t = tot[k]
            t["tokens"] += r["new_tokens"]
            t["wall"] += r["wall_time_s"]
            t["accepted"] += r["accepted"]
            t["drafted"] += r["drafted"]
            t["rounds"] += len(r["accept_lengths"]) if k != "ar" else 0   # verify passes (plain steps not listed)
            t["emitted"] += sum(r["accept_lengths"]) if k != "ar" else 0
            t["draft_s"] += r.get("time_draft_s", 0.0)
            t["mismatch"] += r["token_ids"] != ref["token_ids"]
        print(f"prompt {i + 1}/{len(items)} done", file=sys.stderr)

    ar_rate = tot["ar"]["tokens"] / tot["ar"]["wall"]
    ar_step = tot["ar"]["wall"] / tot["ar"]["tokens"]
    rows = []
    for lb, sh in configs:
        t = tot[(lb, sh)]
        rounds = max(t["rounds"], 1)
        rows.append({"drafter": lb, "shape": sh, **{k: info[lb][k] for k in ("tli", "lsa")},
                     "tok_s": t["tokens"] / t["wall"], "x_ar": t["tokens"] / t["wall"] / ar_rate,
                     "M": t["emitted"] / rounds, "alpha": t["accepted"] / max(t["drafted"], 1),
                     "draft_step_over_decode_step": t["draft_s"] / max(t["drafted"], 1) / ar_step,
                     "mismatches": t["mismatch"]})
    stamp = time.strftime("%Y%m%d-%H%M%S")
    head = (f"### MoA ablation · {a.model} · {device_kind(eng.device)} · {threads} threads · HumanEval "
            f"{len(items)} prompts x {a.max_new_tokens} tokens · greedy · {stamp}\n\n"
            f"swiftk AR {ar_rate:.1f} tok/s. Drafter alone (n-grams off), every round drafts.\n\n"
            "| drafter | TLI | LSA | held-out acceptance by depth (training report) | shape | M | alpha | "
            "draft step / decode step | tok/s | x swiftk AR | mismatches |\n"
            "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        h = info[r["drafter"]]["held_out"] or {}
        acc = h.get("acceptance_by_depth") if isinstance(h, dict) else None
        lines.append(f"| {r['drafter']} | {r['tli']} | {'yes' if r['lsa'] else 'no'} | {acc} | {r['shape']} | "
                     f"{r['M']:.2f} | {r['alpha']:.2f} | {r['draft_step_over_decode_step']:.2f} | {r['tok_s']:.1f} | "
                     f"{r['x_ar']:.2f} | {r['mismatches']} |")
    md = head + "\n".join(lines) + "\n"
    print(md)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"moa-ablation_{a.model}_{device_kind(eng.device)}_{stamp}"
    write_atomic(str(base) + ".md", md)
    write_atomic(str(base) + ".json", json.dumps({"drafters": info, "rows": rows, "ar_tok_s": ar_rate,
                                                  "prompts": len(items), "max_new_tokens": a.max_new_tokens}, indent=1))
    return 1 if any(r["mismatches"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
