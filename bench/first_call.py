"""A user's first call: the first ``generate`` of a process on a fresh $SWIFTK_HOME against the first call of a
process on a warm one and a warm call (same engine, a new learned state, so no earlier output helps it). Each home
gets the model file from the registry cache (no download) and the compiled kernels (their ~100 s build belongs to
``swiftk pull``/``load`` once per machine and would only be timed here as load). Every case is its own process.

    python -m bench.first_call --model smollm2-135m --max-new-tokens 64 --prompts 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Write a short note to a colleague about moving Friday's meeting.",
           "def parse_csv_line(line: str) -> list:\n")

_CHILD = """
import json, sys, time
import swiftk
t = time.perf_counter(); eng = swiftk.load(sys.argv[1]); load = time.perf_counter() - t
out = {"load_s": load}
n = int(sys.argv[3])   # the warm call prefills its prompt whole too: the same prompt would be reused otherwise
t = time.perf_counter(); a = eng.generate(sys.argv[2], max_new_tokens=n); out["first_s"] = time.perf_counter() - t
t = time.perf_counter(); b = eng.generate(sys.argv[2], max_new_tokens=n, state=eng.new_state(), prefix_cache=False)
out["warm_s"] = time.perf_counter() - t
out["same"] = a.token_ids == b.token_ids
print(json.dumps(out))
"""


def run(home: Path, model: str, prompt: str, n: int) -> dict:
    env = {**os.environ, "SWIFTK_HOME": str(home), "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-c", _CHILD, model, prompt, str(n)], env=env, capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.first_call", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    a = ap.parse_args(argv)

    from swiftk.home import swiftk_home
    from swiftk.loading.registry import resolve_model

    src = resolve_model(a.model)   # pulled into the user's cache once; each fresh home gets a copy
    rows = []
    for prompt in PROMPTS[:a.prompts]:
        with tempfile.TemporaryDirectory() as d:
            home = Path(d)
            (home / "models").mkdir()
            for f in src.parent.glob(src.name + "*"):
                shutil.copy(f, home / "models" / f.name)
            if (swiftk_home() / "build").is_dir():
                shutil.copytree(swiftk_home() / "build", home / "build")
            fresh = run(home, a.model, prompt, a.max_new_tokens)
            warm = run(home, a.model, prompt, a.max_new_tokens)   # the same home, now holding what the first made
        rows.append((prompt, fresh, warm))
        print(f"{prompt[:40]!r}: fresh home load {fresh['load_s']:.2f} s, first call {fresh['first_s'] * 1e3:.0f} ms; "
              f"warm home first call {warm['first_s'] * 1e3:.0f} ms; warm call {fresh['warm_s'] * 1e3:.0f} ms; "
              f"fresh first / warm call {fresh['first_s'] / fresh['warm_s']:.2f}x", flush=True)
    worst = max(f["first_s"] / f["warm_s"] for _, f, _ in rows)
    print(f"worst fresh-home first call / warm call: {worst:.2f}x (target <= 1.5x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
