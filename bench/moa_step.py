"""What one MoA draft step costs, in decode steps, and where it goes.

    python -m bench.moa_step --model smollm2-135m [--drafter PATH] [--context 256] [--catch-up 2] [--reps 51]

After a ``--context``-token prompt is in the cache, times (medians of ``--reps``, interleaved): the target's decode
step; the drafter's body (``MoARunner.step``: one call to the kernel library where it is loaded, and its torch
twin op by op), its draft-vocabulary head (``DraftHead.logits_subset``
on the target's LM-head rows, the native block kernel) and the top-k read, each at the engine's torch threads and
at one (what ``moa_draft`` runs with); a 3-step chain as ``moa_draft`` runs it; a round's catch-up on ``--catch-up``
newly verified positions (``MoARunner.sync``, kernel and torch twin); and once, the catch-up per position of the
whole prompt. Writes
``bench/results/moa_step_<model>_<date>.json``.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.moa_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="MoA drafter file (default: the model's own)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--catch-up", type=int, default=2, help="positions a timed round catches up on")
    ap.add_argument("--reps", type=int, default=51)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.context < 16 or not 1 <= a.catch_up <= 8:
        raise SystemExit("--reps must be >= 1, --context >= 16, --catch-up in 1..8")

    import torch
    import swiftk
    from benchlib.machine import machine_info
    from swiftk.atomic import write_json_atomic
    from swiftk.moa.method import load_drafter
    from swiftk.moa.runner import MoARunner

    e = swiftk.load(a.model, persist=False)
    runner = load_drafter(e.target, a.drafter)
    text = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, iteratively.\"\"\"\n    a, b = 0, 1\n"
    ids = (e.encode_prompt(text) * (a.context // 8 + 1))[: a.context]
    e.generate(ids, max_new_tokens=2, method="autoregressive", prefix_cache=False)
    cache, model = e.cache, e.model
    n = cache.length
    committed = ids + [0] * (n - len(ids))
    head = e.draft_head(a.draft_vocab)
    threads = torch.get_num_threads()
    pos = torch.tensor([n])
    runner.reset()
    t = time.perf_counter()
    runner.sync(cache, committed)
    sync_per_token = (time.perf_counter() - t) / n

    def decode():
        model.forward(torch.tensor([5]), pos, pos, cache, start=n)

    # the anchor's input where the drafter has one: a final-normed hidden state, as the verify pass hands it over
    final = model.ops.rmsnorm(model.forward(torch.tensor([5]), pos, pos, cache, start=n,
                                            capture_layer=model.cfg.n_layers)[1], model.norm, model.cfg.rms_eps)
    base = runner.anchor_base(final)   # once a round: the chain's steps share it

    def body():
        runner.step(100, n, base)

    # its torch twin (op by op), on a state of its own caught up alike: the kernel's gain, side by side
    twin = MoARunner(runner.drafter, model, runner.max_slots, native=False)
    twin.sync(cache, committed)

    def body_torch():
        twin.step(100, n, base)

    # a round's catch-up: the state of the positions a round verified (MoARunner.sync), kernel and torch twin
    def catchup():
        runner.n = n - a.catch_up
        runner.sync(cache, committed)

    def catchup_torch():
        twin.n = n - a.catch_up
        twin.sync(cache, committed)

    h = runner.step(100, n, base)

    def head_():
        model.logits_of(h, head.logits_subset)

    lg = model.logits_of(h, head.logits_subset)[0]

    def topk():
        torch.topk(torch.softmax(lg, -1), 4)[1].tolist()

    def chain():
        b = runner.anchor_base(final)
        for j in range(3):
            x = runner.step(100, n + j, b)
            torch.topk(torch.softmax(model.logits_of(x, head.logits_subset)[0], -1), 4)[1].tolist()

    fns = {"decode": (decode, threads), **{f"{k}@{th}": (f, th) for k, f in
                                            (("body", body), ("body_torch", body_torch), ("head", head_), ("topk", topk),
                                             ("catchup", catchup), ("catchup_torch", catchup_torch))
                                            for th in (threads, 1)},
           "chain3@1": (chain, 1)}
    times = {k: [] for k in fns}
    for _ in range(3):   # warm-up
        for f, th in fns.values():
            f()
    for _ in range(a.reps):
        for k, (f, th) in fns.items():
            torch.set_num_threads(th)
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    torch.set_num_threads(threads)
    med = {k: statistics.median(v) for k, v in times.items()}
    med["chain3@1"] /= 3
    step = med["decode"]
    res = {"args": vars(a), "machine": machine_info(e.device, threads), "drafter": runner.info,
           "median_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
           "in_decode_steps": {k: round(v / step, 3) for k, v in med.items()},
           "sync_ms_per_verified_token": round(sync_per_token * 1e3, 3), "draft_vocab_rows": len(head)}
    for k, v in med.items():
        print(f"{k:>12}: {v * 1e3:7.3f} ms  {v / step:6.3f} decode steps")
    print(f"sync: {sync_per_token * 1e3:.3f} ms per verified token ({sync_per_token / step:.3f} decode steps)")
    path = Path(a.out) / f"moa_step_{Path(a.model).name.removesuffix('.gguf')}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json_atomic(path, res)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
