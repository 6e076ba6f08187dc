"""KVQ cache: is reusing the draft's exact lower layers a net win for the verify pass on this device?

    python -m bench.kvq --model smollm2-135m --repeats 20

For an early-exit draft (exit at n/2 and 3n/4) and for a layer-skip draft (a SWIFT-like set whose first skipped layer
is --boundary), one draft round on a real prompt, then the same verify pass timed with and without the KVQ cache,
interleaved. Prints per case: tree size, spine nodes reused, the boundary layer, both times and their ratio.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchlib.machine import set_threads, sync


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kvq", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--boundary", type=int, default=4, help="first skipped layer of the layer-skip case")
    ap.add_argument("--budget", type=int, default=0, help="tree nodes (default: the engine's measured budget)")
    a = ap.parse_args(argv)
    set_threads(a.threads)

    import swiftk
    from swiftk.proposers.draft_loop import draft
    from swiftk.options import DecodeConfig
    from swiftk.decoding.gate import Gate
    from swiftk.sample.sampler import Sampler, SamplingParams
    from swiftk.decoding.state import GateMemory
    from swiftk.decoding.loop import verify
    from swiftk.runtime.skipset import kvq_boundary
    from swiftk.decoding.tree import GREEDY_TOPK, build_tree

    eng = swiftk.load(a.model, device=a.device, dtype=a.dtype)
    m, cache, dev = eng.model, eng.cache, eng.device
    L = eng.config.n_layers
    budget = a.budget or eng.costs.budget()
    ids = eng.tokenizer.encode("def quicksort(xs):\n    \"\"\"Sort a list of integers.\"\"\"\n")
    P = len(ids)
    sampler = Sampler(SamplingParams(0.0).validate(), dev)
    gate = Gate(eng.costs, GateMemory(), DecodeConfig(speculate="always", eps=0.0))   # draft max_draft deep
    sk = torch.zeros(2 * L, dtype=torch.bool)
    sk[2 * a.boundary::3] = True  # every third sublayer from the boundary on, last layer kept
    sk[-2:] = False
    cases = [(f"early exit E={e}", eng.states.early_exit(e)) for e in sorted({L // 2, (3 * L) // 4})]
    cases.append((f"layer skip ({int(sk.sum())} sublayers)", sk))
    print(f"# {a.model} on {dev}, {a.dtype}; tree budget {budget}; {a.repeats} interleaved repeats; times in ms")
    print(f"{'draft':<26} {'nodes':>5} {'spine':>5} {'f':>3} {'plain':>8} {'kvq':>8} {'kvq/plain':>9}")
    for name, skip in cases:
        f = kvq_boundary(skip)
        cache.reset()
        m.forward(torch.tensor(ids[:-1], device=dev), torch.arange(P - 1, device=dev),
                  torch.arange(P - 1, device=dev), cache)
        cache.reset()
        cache.advance(P - 1)
        levels = draft(m, cache, ids[-1], skip.to(dev), sampler, gate, lambda p: p, 0.0, max_draft=a.max_draft,
                       max_spine=budget - 1, topk_bins=GREEDY_TOPK, boundary=f)
        tree = build_tree(ids[-1], levels, P - 1, budget, dev)
        if tree is None:   # nothing drafted to verify
            continue
        times = {"plain": [], "kvq": []}
        for r in range(a.repeats + 1):
            for kind in (("plain", "kvq") if r % 2 else ("kvq", "plain")):
                sync(dev)
                t = time.perf_counter()
                verify(m, cache, tree, levels, None if kind == "plain" else f)
                sync(dev)
                if r:  # the first round is warm-up
                    times[kind].append(time.perf_counter() - t)
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
        print(f"{name:<26} {tree.size:>5} {tree.n_spine:>5} {f:>3} {med['plain']:>8.2f} {med['kvq']:>8.2f} "
              f"{med['kvq'] / med['plain']:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
