"""swiftk autoregressive vs Hugging Face ``generate`` (greedy), same GGUF weights and prompt ids, one process.

    python -m bench.ar_vs_hf --model smollm2-135m --prompts 5 --max-new-tokens 64

Runs alternate per prompt (swiftk, HF, then HF, swiftk on the next prompt, ...) so machine noise hits both alike.
Prints tokens/s of both, their ratio, and whether the greedy token ids are identical (``--strict``: exit 1 if not).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from swiftk.errors import SwiftkError


def main(argv=None) -> int:
    from benchlib.machine import device_kind, set_threads
    from benchlib.prompts import build_prompts, first_diff, WORKLOAD_NAMES
    from bench.e2e import _hf_run, _swiftk_run, load_pair

    ap = argparse.ArgumentParser(prog="python -m bench.ar_vs_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="humaneval", choices=WORKLOAD_NAMES[:2])
    ap.add_argument("--prompts", type=int, default=5, help="HumanEval prompts / MT-Bench questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when any token differs")
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.max_new_tokens < 1:
        ap.error("--prompts and --max-new-tokens must be >= 1")
    try:
        threads = set_threads(a.threads)
        t0 = time.perf_counter()
        eng, hf, why = load_pair(a.model, a.device, a.dtype)
        if hf is None:
            raise SwiftkError(f"HF model unavailable: {why}")
        print(f"# {a.model} {a.dtype} {device_kind(eng.device)} threads={threads}; loaded both in "
              f"{time.perf_counter() - t0:.1f}s")
        items = build_prompts(eng, [a.workload], a.prompts, a.prompts)[a.workload]
    except SwiftkError as e:
        print(f"bench.ar_vs_hf: error: {e}", file=sys.stderr)
        return 2

    _swiftk_run(eng, items[0]["ids"], 8)  # warm-up both
    _hf_run(hf, items[0]["ids"], 8, "greedy")
    tot = {"swiftk": [0, 0.0], "hf": [0, 0.0]}
    bad = 0
    print(f"{'prompt':24s} {'swiftk tok/s':>12s} {'hf tok/s':>9s} {'ratio':>6s}  tokens")
    for i, it in enumerate(items):
        order = ("swiftk", "hf") if i % 2 == 0 else ("hf", "swiftk")
        got = {}
        for who in order:
            got[who] = (_swiftk_run(eng, it["ids"], a.max_new_tokens) if who == "swiftk"
                        else _hf_run(hf, it["ids"], a.max_new_tokens, "greedy"))
            tot[who][0] += got[who]["new_tokens"]
            tot[who][1] += got[who]["wall_time_s"]
        s, h = (got[k]["new_tokens"] / got[k]["wall_time_s"] for k in ("swiftk", "hf"))
        d = first_diff(got["swiftk"]["token_ids"], got["hf"]["token_ids"])
        same = "identical" if d is None else f"DIFFER at {d}"
        if d is not None:
            bad += 1
            print(f"MISMATCH swiftk-ar {it['id']} {d}", file=sys.stderr)
        print(f"{it['id']:24s} {s:12.1f} {h:9.1f} {s / h:6.2f}  {got['swiftk']['new_tokens']} {same}")
    s, h = (tot[k][0] / tot[k][1] for k in ("swiftk", "hf"))
    print(f"{'TOTAL':24s} {s:12.1f} {h:9.1f} {s / h:6.2f}  "
          f"{'all identical' if not bad else f'{bad} of {len(items)} prompts differ'}")
    return 1 if (a.strict and bad) else 0


if __name__ == "__main__":
    raise SystemExit(main())
