"""Where the decode loop's host time goes on a device: ms per token of each method on one prompt, then cProfile's
top functions (by own time) of the default method. Used to find per-round overhead that a fast device exposes.

python bench/device/profile_loop.py --model smollm2-135m --device cuda --dtype bfloat16 --out loop.txt
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import swiftk
from swiftk.atomic import write_atomic


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    eng = swiftk.load(a.model, device=a.device, dtype=a.dtype, persist=False)
    prompt = "def quicksort(xs):\n    \"\"\"Sort a list of numbers.\"\"\"\n"
    lines = []
    graphs = eng.model.graphs
    for m in ("autoregressive", "ngram", "swift"):
        eng.generate(prompt, max_new_tokens=32, method=m)
        captured = graphs.info()["captured"] if graphs is not None else 0
        t = time.perf_counter()
        r = eng.generate(prompt, max_new_tokens=a.tokens, method=m, stop=[])
        dt = time.perf_counter() - t
        s = r.stats
        n = max(1, s.decoding_steps)
        lines.append(f"{m:15s} {dt / len(r.token_ids) * 1e3:7.3f} ms/token  steps {s.decoding_steps}  "
                     f"plain {s.plain_steps}  tokens {len(r.token_ids)}  per step: draft "
                     f"{s.time_draft_s / n * 1e3:.3f} verify {s.time_verify_s / n * 1e3:.3f} other "
                     f"{s.time_other_s / n * 1e3:.3f} optimize {s.time_optimize_s / n * 1e3:.3f} ms  graphs "
                     f"captured {(graphs.info()['captured'] if graphs is not None else 0) - captured}")
    for m in ("ngram", "swift"):
        pr = cProfile.Profile()
        pr.enable()
        eng.generate(prompt, max_new_tokens=a.tokens, method=m, stop=[])
        if torch.device(a.device).type == "cuda":
            torch.cuda.synchronize()
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        lines.append(f"--- cProfile {m} (by own time)\n" + buf.getvalue())
    text = "\n".join(lines)
    print(text)
    write_atomic(a.out, text + "\n")


if __name__ == "__main__":
    main()
