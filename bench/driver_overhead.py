"""What the one driver costs a lone call, in process: ``generate`` (the scheduler, a batch of one) against the bare
loops the engine ran before (issue 82), on the same engine and the same opened call.

    python -m bench.driver_overhead --models smollm2-135m,qwen2.5-coder-0.5b --n 4 --reps 5

Arms, alternated per prompt (the order rotates), on one engine per method: ``generate`` as users call it, and
``bare``: the same request opened by ``Calls.open_call`` on slot 0, then for the reference method the plain loop
(``decoding.passes.autoregressive``: prefill, then one ``plain_step`` a token), for the default the Decoder's
plan / run / finish in a while loop (the lone driver before the scheduler drove every call), closed by
``Calls.close_call``. Both arms open the call the same way (for the reference method that builds a Session the
bare loop does not use, ~0.3 ms a call), so the ratio is the rounds' cost, not the call's setup. Tokens/s = generated tokens / wall time of the calls (prefill included); per model and
method the true median over repetitions of generate ÷ bare and every repetition; every output must be equal.
Writes ``driver_overhead_<date>.json`` / ``.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import statistics
import time


def bare(eng, req):
    """The call decoded by the loop the engine ran before the scheduler drove every call."""
    from swiftk.decoding.passes import autoregressive

    with eng.calls.hold():
        call = eng.calls.open_call(req, 0)
        try:
            if not req.method.speculative:
                stats = autoregressive(eng.model, call.slot.cache, req.ids, call.sampler, call.sink, call.reuse)
            else:
                d = call.decoder
                while not d.done:
                    p = d.plan()
                    t = time.perf_counter()
                    logits = d.run(p)
                    d.finish(p, logits, time.perf_counter() - t)
                stats = d.close()
        finally:
            call.end()
        return eng.calls.close_call(call, stats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.driver_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--n", type=int, default=4, help="prompts per workload (HumanEval, chat; held out)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=5, help="odd: the median is a run's")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.reps % 2 == 0 or a.n < 1:
        raise SystemExit("--reps must be odd and >= 1, --n >= 1")
    import torch
    import swiftk
    from bench.checkout_ab import prompts
    from benchlib.machine import machine_info
    from benchlib.results import write_result

    items = prompts(a.n)
    kw = {"ar": {"method": "autoregressive"}, "default": {}}
    summary, lines = {}, [f"# The one driver against the bare loops: {a.reps} reps, {len(items)} prompts, "
                          f"{a.max_new_tokens} new tokens, prefill included", "",
                          "| model | method | generate tok/s | bare tok/s | generate ÷ bare | each rep | outputs equal |",
                          "|---|---|---:|---:|---:|---|---|"]
    for model in [m for m in a.models.split(",") if m]:
        engines = {m: swiftk.load(model, persist=False) for m in kw}
        for m, e in engines.items():   # kernels, corpus tables, draft head: built before anything is timed
            e.corpus(wait=True)
            e.generate(items[0]["text"], chat=items[0]["chat"], max_new_tokens=8, **kw[m])
        for m, e in engines.items():
            reps, same, k = [], True, 0
            for _ in range(a.reps):
                wall, new = {"generate": 0.0, "bare": 0.0}, {"generate": 0, "bare": 0}
                for p in items:
                    outs = {}
                    for arm in (("generate", "bare") if k % 2 == 0 else ("bare", "generate")):
                        opts = dict(chat=p["chat"], max_new_tokens=a.max_new_tokens, prefix_cache=False, **kw[m])
                        t = time.perf_counter()
                        out = e.generate(p["text"], **opts) if arm == "generate" else bare(e, e.calls.request(p["text"],
                                                                                                        **opts))
                        wall[arm] += time.perf_counter() - t
                        new[arm] += len(out.token_ids)
                        outs[arm] = out.token_ids
                    k += 1
                    same &= outs["generate"] == outs["bare"]
                reps.append({arm: new[arm] / wall[arm] for arm in wall})
            each = [r["generate"] / r["bare"] for r in reps]
            g, b = (statistics.median(r[arm] for r in reps) for arm in ("generate", "bare"))
            summary[f"{model}/{m}"] = {"generate": g, "bare": b, "ratio": statistics.median(each), "each": each,
                                       "outputs_equal": same}
            lines.append(f"| {model} | {m} | {g:.1f} | {b:.1f} | {statistics.median(each):.3f} | "
                         f"{', '.join(f'{x:.3f}' for x in each)} | {'yes' if same else 'NO'} |")
            print(lines[-1], flush=True)
    doc = {"args": vars(a), "machine": machine_info(torch.device("cpu"), torch.get_num_threads()), "summary": summary}
    print("\n".join(lines))
    write_result(a.out, "driver_overhead", "\n".join(lines) + "\n", doc)
    return 0 if all(v["outputs_equal"] for v in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
