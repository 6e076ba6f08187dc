"""Free drafting end to end: swiftk's default against its own autoregressive decoding and against llama.cpp (plain
and with prompt-lookup speculation, llama-cpp-python) on the same GGUF file with the same threads, on the workloads
where drafting matters: HumanEval, MT-Bench (turn 1; per category), edits, code chat, MT-Bench turn 2 with the
model's own turn-1 answer in context. Arms are interleaved prompt by prompt in one process. Wall times include
the prefill; "decode only" takes each call's own prefill (its ``stats.time_prefill_s``) out of both sides.

    python -m bench.drafting --model smollm2-135m --n 8 --n-mtbench 2 --max-new-tokens 128

Arms: ``swiftk-ar`` (autoregressive), ``swiftk`` (the default ``generate``), ``swiftk-pld`` (prompt lookup
alone: ``method="ngram"`` with history, recycle and corpus off), ``llamacpp-ar``, ``llamacpp-pld``
(``LlamaPromptLookupDecoding``, 2 tokens per step: its advice for CPUs), and with ``--draft-model NAME``
``swiftk-dm`` (the default ``generate`` of an engine loaded with that draft model). ``swiftk-ar`` runs on an engine of its own
(its steps never feed the speculative arms' cost model, nor theirs its caches). swiftk's speculative arms each keep one learned state per workload
(history and estimates carry from prompt to prompt, as in a server) and must give swiftk-ar's tokens (the run
fails otherwise). llama.cpp computes with the file's quantized blocks, so its tokens may differ from swiftk's:
reported, never a losslessness check. Writes bench/results/drafting_<model>_<date>.md and .json.
The llama.cpp arms go through llama-cpp-python's wrapper (flash attention off; its prompt lookup is a Python
re-implementation): a secondary column. llama.cpp as its users run it is measured by bench/versus_native.py
(llama-bench) and bench/serve_load.py (llama-server, with its own --spec-type speculation).

``--repeat R`` runs every prompt R times, the arms in alternated order, each repetition from fresh learned states
(history and estimates carried prompt to prompt within it, as in one run), and takes each prompt's median wall
time per arm: on this project's VMs one run of one answer moves by +-7% (identical work read 0.92-1.14x), so a
category of two answers needs repetitions before a ratio under 1.0x means anything.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchlib.llamacpp import llamacpp_run

ARMS = ("swiftk-ar", "swiftk", "swiftk-pld", "llamacpp-ar", "llamacpp-pld", "swiftk-dm")
WORKLOADS = ("humaneval", "mtbench", "edit", "chat", "multiturn")
PLD_OFF = {"history": False, "recycle": False, "datastore": False}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--n", type=int, default=8, help="HumanEval, edit and chat prompts")
    ap.add_argument("--n-mtbench", type=int, default=2, help="MT-Bench questions per category (turn 1 and 2)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--skip", type=int, default=0, help="pass over the first HumanEval/edit/chat prompts (held out)")
    ap.add_argument("--skip-mtbench", type=int, default=0, help="pass over the first MT-Bench questions per category")
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default (all cores)")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--weights", default=None, help="swiftk's weight format (default: swiftk's choice, native "
                    "for a quantized GGUF on CPU; float32 for the dequantized path)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every prompt, arms in alternated order, fresh "
                    "learned states per run; each prompt's median wall time per arm")
    ap.add_argument("--draft-model", default=None, help="also run swiftk-dm: the default generate of an engine "
                    "loaded with this draft model (registry name or path)")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    if a.repeat < 1 or a.repeat % 2 == 0:
        # an even count has no middle run: its "median" was the faster of the two middle ones, which flattered
        raise SystemExit("--repeat must be odd (1, 3, 5, ...): the median is then a run")

    import swiftk
    from benchlib.machine import machine_info, read_bandwidth
    from benchlib.prompts import build_prompts
    from benchlib.llamacpp import load_llamacpp

    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    eng = swiftk.load(a.model, persist=False, weights=a.weights)
    eng_ar = swiftk.load(a.model, persist=False, weights=a.weights)   # the reference arm's own engine
    eng_dm = swiftk.load(a.model, persist=False, weights=a.weights, draft_model=a.draft_model) \
        if a.draft_model else None
    eng.corpus(wait=True)   # every arm drafts from the same sources; no build runs beside a timing
    from swiftk.loading.registry import resolve_model

    gguf = resolve_model(a.model)
    peers, why = {}, "--no-llamacpp"
    if not a.no_llamacpp:
        for arm, pl in (("llamacpp-ar", 0), ("llamacpp-pld", 2)):   # 2: what llama-cpp-python advises on CPU
            llm, why = load_llamacpp(gguf, threads, n_ctx=4096, prompt_lookup=pl)
            if llm is not None:
                peers[arm] = llm
    prompts = build_prompts(eng, a.workloads.split(","), a.n, a.n_mtbench, a.max_new_tokens, a.skip,
                            a.skip_mtbench)
    eos = eng.tokenizer.eos_ids
    warm = next(iter(prompts.values()))[0]["ids"]
    eng_ar.generate(warm, max_new_tokens=16, method="autoregressive")   # kernels
    eng.generate(warm, max_new_tokens=16, method="autoregressive")      # kernels, draft head, corpus tables
    eng.generate(warm, max_new_tokens=16, state=eng.new_state())
    if eng_dm is not None:
        eng_dm.corpus(wait=True)
        eng_dm.generate(warm, max_new_tokens=16, state=eng_dm.new_state())
    for llm in peers.values():
        llamacpp_run(llm, warm, 8, eos)

    read_gb_s = [round(read_bandwidth(), 1)]   # the VM's memory mode at the start and the end of the run
    rows: dict = {}   # (workload, prompt index) -> {arm: [one result per repetition]}
    for rep in range(a.repeat):
        order = ARMS if rep % 2 == 0 else ARMS[::-1]
        for w, items in prompts.items():
            states = {"swiftk": eng.new_state(), "swiftk-pld": eng.new_state()}
            if eng_dm is not None:
                states["swiftk-dm"] = eng_dm.new_state()
            for i, it in enumerate(items):
                got = rows.setdefault((w, i), {})
                for arm in (x for x in order if x in peers or x in states or x == "swiftk-ar"):
                    got.setdefault(arm, []).append(_run_arm(arm, a, it, eng, eng_ar, peers, states, eos, eng_dm))
                for arm in states:
                    if got[arm][-1]["tokens"] != got["swiftk-ar"][-1]["tokens"]:
                        raise SystemExit(f"{arm} differs from swiftk-ar on {it['id']}: not lossless")
                print(w, it["id"], f"run {rep + 1}/{a.repeat}" if a.repeat > 1 else "",
                      {k: round(len(v[-1]["tokens"]) / v[-1]["wall_s"], 1) for k, v in got.items()
                       if "wall_s" in v[-1]}, flush=True)
    runs = []
    for (w, i), got in rows.items():
        it = prompts[w][i]
        row = {"workload": w, "id": it["id"], "category": it["category"], "prompt_tokens": len(it["ids"])}
        for arm, results in got.items():
            ok = [r for r in results if "wall_s" in r]
            if len(ok) < len(results):   # an arm that raised in any repetition leaves that prompt out
                row.setdefault("failed", {})[arm] = next(r["failed"] for r in results if "failed" in r)
                continue
            row[arm] = _median_run(ok)
        runs.append(row)
    summary = aggregate(runs)
    read_gb_s.append(round(read_bandwidth(), 1))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"args": vars(a), "machine": {**machine_info(eng.device, threads), "read_gb_s": read_gb_s},
            "gguf": str(gguf),
            "weights": eng.info()["weights"] or "float32",
            "llamacpp": sorted(peers) or why}
    (out / f"drafting_{a.model}_{stamp}.json").write_text(json.dumps({**meta, "summary": summary, "runs": runs}))
    (out / f"drafting_{a.model}_{stamp}.md").write_text(markdown(a, meta, summary))
    print(markdown(a, meta, summary))
    return 0


def _run_arm(arm, a, it, eng, eng_ar, peers, states, eos, eng_dm=None) -> dict:
    """One arm on one prompt: its tokens and times, or {"failed": why} (llama.cpp's own errors)."""
    if arm.startswith("llamacpp"):
        try:
            r = llamacpp_run(peers[arm], it["ids"], a.max_new_tokens, eos)
        except Exception as e:   # llama-cpp-python's own bug (its prompt lookup overflowing its scores buffer): that
            # arm misses this prompt, its ratios use the prompts it ran
            return {"failed": f"{type(e).__name__}: {e}"[:200]}
        return {"tokens": r["token_ids"], "wall_s": r["wall_time_s"]}
    kw = ({"method": "autoregressive"} if arm == "swiftk-ar" else
          {"state": states[arm], **({"method": "ngram", **PLD_OFF} if arm == "swiftk-pld" else {})})
    e = eng_ar if arm == "swiftk-ar" else eng_dm if arm == "swiftk-dm" else eng
    t = time.perf_counter()
    # each prompt prefilled whole, as llama.cpp's arm does after its reset: repetitions would reuse it otherwise
    r = e.generate(it["ids"], max_new_tokens=a.max_new_tokens, prefix_cache=False, **kw)
    return {"tokens": r.token_ids, "wall_s": time.perf_counter() - t, "prefill_s": r.stats.time_prefill_s,
            "search_s": r.stats.time_optimize_s,
            "by_source": dict(r.stats.accepted_by_source) if arm != "swiftk-ar" else {}}


def _median_run(results: list) -> dict:
    """The repetition with the median wall time (an odd count: main() refuses even ones), all wall times beside."""
    r = dict(sorted(results, key=lambda x: x["wall_s"])[(len(results) - 1) // 2])
    if len(results) > 1:
        r["walls_s"] = [x["wall_s"] for x in results]
    return r


def _rate(rows, arm):
    rows = [r for r in rows if arm in r]
    toks, wall = sum(len(r[arm]["tokens"]) for r in rows), sum(r[arm]["wall_s"] for r in rows)
    return (toks / wall if wall else None), toks, wall


def aggregate(runs: list) -> dict:
    """Per workload (and per MT-Bench category): tok/s per arm (total tokens / total wall), ratios."""
    groups = {}
    for r in runs:
        groups.setdefault((r["workload"], ""), []).append(r)
        if r["workload"] in ("mtbench", "multiturn"):
            groups.setdefault((r["workload"], r["category"]), []).append(r)
    out = {}
    for (w, cat), rows in groups.items():
        g = {arm: _rate(rows, arm)[0] for arm in ARMS}
        ar, lar = g["swiftk-ar"], g["llamacpp-ar"]
        g["n"] = len(rows)
        ar_d, sw_d = (sum(r[arm]["wall_s"] - r[arm]["prefill_s"] for r in rows) for arm in ("swiftk-ar", "swiftk"))
        g["decode_only"] = ar_d / sw_d if sw_d > 0 else None
        g["swiftk/ar"] = g["swiftk"] / ar if ar else None
        both = [r for r in rows if "llamacpp-pld" in r]   # the prompts llama.cpp's prompt lookup ran
        if g["swiftk-dm"] is not None:   # the draft-model arm against the same references
            dm_d = sum(r["swiftk-dm"]["wall_s"] - r["swiftk-dm"]["prefill_s"] for r in rows)
            g["dm_decode_only"] = ar_d / dm_d if dm_d > 0 else None
            g["dm/ar"] = g["swiftk-dm"] / ar if ar else None
            g["dm/llamacpp-ar"] = g["swiftk-dm"] / lar if lar else None
            g["dm/llamacpp-pld"] = _rate(both, "swiftk-dm")[0] / _rate(both, "llamacpp-pld")[0] if both else None
        g["pld/ar"] = g["swiftk-pld"] / ar if ar else None
        g["llamacpp-pld/its-ar"] = g["llamacpp-pld"] / lar if lar and g["llamacpp-pld"] else None
        g["swiftk/llamacpp-pld"] = _rate(both, "swiftk")[0] / _rate(both, "llamacpp-pld")[0] if both else None
        g["llamacpp_failed"] = sum(len(r.get("failed", {})) for r in rows)
        g["llamacpp_same_tokens"] = (sum(r["llamacpp-ar"]["tokens"] == r["swiftk-ar"]["tokens"] for r in rows
                                         if "llamacpp-ar" in r) if lar else None)
        src = {}
        for r in rows:
            for k, v in r["swiftk"]["by_source"].items():
                src[k] = src.get(k, 0) + v
        g["accepted_by_source"] = src
        wall = sum(r["swiftk"]["wall_s"] for r in rows)
        g["search_share"] = sum(r["swiftk"].get("search_s", 0.0) for r in rows) / wall if wall else None
        out[f"{w}/{cat}" if cat else w] = g
    return out


def _pct(x):
    return None if x is None else 100 * x


def markdown(a, meta, summary) -> str:
    f = lambda x, s="{:.1f}": "–" if x is None else s.format(x)   # noqa: E731
    lines = [f"# Free drafting: {a.model}, {a.max_new_tokens} new tokens", "",
             f"`python -m bench.drafting --model {a.model} --workloads {a.workloads} --n {a.n} --n-mtbench "
             f"{a.n_mtbench} --max-new-tokens {a.max_new_tokens}" + (f" --weights {a.weights}" if a.weights else "")
             + (f" --skip {a.skip} --skip-mtbench {a.skip_mtbench}" if a.skip or a.skip_mtbench else "")
             + (f" --repeat {a.repeat}" if a.repeat > 1 else "")
             + (f" --draft-model {a.draft_model}" if a.draft_model else "") + "`",
             "", f"Machine: {meta['machine']}; swiftk weights: {meta['weights']}; llama.cpp arms: {meta['llamacpp']}",
             "",
             "| workload | n | swiftk AR tok/s | swiftk default | default ÷ AR | (decode only) | prompt lookup ÷ AR | "
             "llama.cpp AR | llama.cpp PLD | its PLD ÷ its AR | default ÷ llama.cpp PLD | default ÷ llama.cpp AR | "
             "accepted by source | skip-set search |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for k, g in summary.items():
        lines.append(f"| {k} | {g['n']} | {f(g['swiftk-ar'])} | {f(g['swiftk'])} | {f(g['swiftk/ar'], '{:.2f}x')} | "
                     f"{f(g.get('decode_only'), '{:.2f}x')} | "
                     f"{f(g['pld/ar'], '{:.2f}x')} | {f(g['llamacpp-ar'])} | {f(g['llamacpp-pld'])} | "
                     f"{f(g['llamacpp-pld/its-ar'], '{:.2f}x')} | {f(g['swiftk/llamacpp-pld'], '{:.2f}x')} | "
                     f"{f(g['swiftk'] / g['llamacpp-ar'] if g['swiftk'] and g['llamacpp-ar'] else None, '{:.2f}x')} | "
                     f"{g['accepted_by_source']} | {f(_pct(g.get('search_share')), '{:.1f}%')} |")
    if any(g.get("dm/ar") is not None for g in summary.values()):
        lines += ["", f"With the draft model {a.draft_model} (`swiftk-dm`: the default generate of an engine loaded "
                      "with it; wall time with both prefills):", "",
                  "| workload | n | swiftk-dm tok/s | ÷ swiftk AR | (decode only) | ÷ swiftk default | ÷ llama.cpp AR | "
                  "÷ llama.cpp PLD |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for k, g in summary.items():
            lines.append(f"| {k} | {g['n']} | {f(g['swiftk-dm'])} | {f(g['dm/ar'], '{:.2f}x')} | "
                         f"{f(g.get('dm_decode_only'), '{:.2f}x')} | "
                         f"{f(g['swiftk-dm'] / g['swiftk'] if g['swiftk'] else None, '{:.2f}x')} | "
                         f"{f(g['dm/llamacpp-ar'], '{:.2f}x')} | {f(g['dm/llamacpp-pld'], '{:.2f}x')} |")
    failed = {k: g["llamacpp_failed"] for k, g in summary.items() if g.get("llamacpp_failed") and ":" not in k}
    if failed:
        lines += ["", f"llama.cpp runs that raised inside llama-cpp-python (that arm's tok/s and ratios leave those "
                      f"prompts out): {failed}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
