"""CPU matmul form: a whole-model forward of T tokens with the runtime's ``linear`` against plain ``x @ W.T``.

    python -m bench.linear --model smollm2-135m --repeats 10

``swiftk.runtime.model.linear`` computes (W @ x.T).T on CPU for T >= 2. This swaps the module's ``linear`` for the plain
form and back, interleaved per T, after a 200-token prefill; prints the median forward time of each form, their
ratio, and each one's cost in decode steps (T = 1 of the same form).
"""
from __future__ import annotations

import argparse
import time

import torch

from benchlib.machine import set_threads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.linear", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    a = ap.parse_args(argv)
    set_threads(a.threads)

    import swiftk
    import swiftk.runtime.model as M

    eng = swiftk.load(a.model, device="cpu", dtype="float32")
    m, cache = eng.model, eng.cache
    forms = {"plain": lambda x, w: x @ w.T, "swiftk": M.linear}

    def fwd(T):
        pos = torch.arange(200, 200 + T)
        m.forward(torch.randint(0, 1000, (T,)), pos, pos, cache)

    fwd(200)  # prefill: the timed passes attend to 200 cached tokens
    Ts = [int(t) for t in a.tokens.split(",")]
    times = {(f, T): [] for f in forms for T in Ts}
    try:
        for _ in range(a.repeats):
            for T in Ts:
                for f, fn in forms.items():
                    M.linear = fn
                    fwd(T)  # warm this shape
                    t = time.perf_counter()
                    fwd(T)
                    times[(f, T)].append(time.perf_counter() - t)
    finally:
        M.linear = forms["swiftk"]
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    print(f"# {a.model}, cpu fp32, {torch.get_num_threads()} threads, median of {a.repeats} interleaved runs, ms")
    print(f"{'T':>3} {'x @ W.T':>9} {'swiftk':>9} {'ratio':>6} {'steps(plain)':>13} {'steps(swiftk)':>14}")
    for T in Ts:
        p, s = med[("plain", T)], med[("swiftk", T)]
        print(f"{T:>3} {p:>9.1f} {s:>9.1f} {s / p:>6.2f} {p / med[('plain', Ts[0])]:>13.2f} "
              f"{s / med[('swiftk', Ts[0])]:>14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
