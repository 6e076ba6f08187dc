"""Greedy tokens of every decoding method on a few committed bench prompts, written to a JSON file.

A refactor that claims "no behaviour change" runs this before and after and compares the files:
    python tools/check_greedy.py /tmp/before.json     # on the old tree
    python tools/check_greedy.py /tmp/after.json --compare /tmp/before.json
Uses SmolLM2-135M on CPU, persist=False (no learned state read from or written to disk), so two runs of one tree
give the same tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/ is not installed: run from a checkout

import swiftk  # noqa: E402
from swiftk import methods  # noqa: E402

from benchlib import workloads  # noqa: E402

N_NEW = 40
N_PROMPTS = 3
SKIP_SET = {"attention": [3, 5, 7, 9, 11], "mlp": [4, 6, 8, 10, 12]}   # a fixed set for method="static"


def prompts() -> list:
    return [p["turns"][0] for p in workloads.humaneval(N_PROMPTS)]


def method_kwargs(name: str, n_layers: int) -> dict:
    if name == "static":
        return {"skip_set": SKIP_SET}
    if name == "early_exit":
        return {"exit_layer": n_layers // 2}
    return {}


def run() -> dict:
    out = {}
    for weights in (None, "float32"):   # the default (native GGUF blocks) and the float32 path
        eng = swiftk.load("smollm2-135m", persist=False, weights=weights)
        n_layers = eng.config.n_layers
        for name in methods.names():
            if name == "draft_model":   # needs a smaller sibling loaded beside the target; SmolLM2 has none
                continue
            for i, prompt in enumerate(prompts()):
                r = eng.generate(prompt, max_new_tokens=N_NEW, method=name, **method_kwargs(name, n_layers))
                out[f"{weights or 'default'}/{name}/{i}"] = list(r.token_ids)
                print(f"{weights or 'default'}/{name}/{i}: {len(r.token_ids)} tokens", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--compare", help="a JSON written by an earlier run; exit 1 on any difference")
    args = ap.parse_args(argv)
    got = run()
    with open(args.out, "w") as f:
        json.dump(got, f, indent=0)
    if args.compare:
        with open(args.compare) as f:
            ref = json.load(f)
        diff = sorted(k for k in set(ref) | set(got) if ref.get(k) != got.get(k))
        print(f"{len(got)} runs, {len(diff)} differ from {args.compare}" + (f": {diff}" if diff else ""))
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
