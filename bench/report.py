"""Print the bench.e2e tables (Markdown) from the latest bench.e2e results under bench/results.

    python -m bench.report [--results bench/results] [--device-kind cpu] [--model NAME ...]

Takes, per model (and device kind), the newest ``*.summary.json`` (by the date inside it) and renders its tables,
the machine it ran on and the command that reproduces it. Its tables are in the run history
(bench/results/history.md); docs/performance.md cites the runs that are current.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HF_PREFIX = "hf-"
MAIN_METHODS_ORDER = ("hf-greedy", "hf-pld", "swiftk-ar", "swift-cold", "swift-nohist", "swift-paper", "swiftk-ngram",
                      "swift-warm", "swift-saved")


def latest_summaries(results: Path, device_kind=None, models=None) -> list:
    """Newest summary per (model, device kind, workload): a later run of one workload (say the domain-shift
    stream) does not hide an earlier run's other workloads. Returns [(path, summary)] where each summary's
    ``results`` holds only the workloads it is the newest for."""
    best: dict = {}
    for p in sorted(results.glob("*.summary.json")):
        try:
            s = json.loads(p.read_text())
            meta = s["meta"]
            workloads = list(s["results"])
        except (OSError, ValueError, KeyError, TypeError):
            print(f"skipping unreadable {p}", file=sys.stderr)
            continue
        if device_kind and meta.get("device_kind") != device_kind:
            continue
        if models and meta.get("model") not in models:
            continue
        for w in workloads:
            key = (meta.get("model"), meta.get("device_kind"), w)
            if key not in best or meta.get("date", "") > best[key][1]["meta"].get("date", ""):
                best[key] = (p, s)
    picked: dict = {}  # path -> (summary, its workloads to show), in (device kind, model) order
    for k in sorted(best, key=lambda k: (k[1] or "", k[0] or "")):
        p, s = best[k]
        picked.setdefault(p, (s, []))[1].append(k[2])
    return [(p, {**s, "results": {w: s["results"][w] for w in s["results"] if w in ws}})
            for p, (s, ws) in picked.items()]


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def _order(methods):
    def key(m):
        return (MAIN_METHODS_ORDER.index(m) if m in MAIN_METHODS_ORDER else
                (1.5 if m.startswith("hf-ee") else 99), m)
    return sorted(methods, key=key)


def render(items) -> str:
    out = ["## Performance", ""]
    if not items:
        out += ["No results yet: run `python -m bench.e2e` (see below).", ""]
        return "\n".join(out)
    out += ["Greedy decoding, one process per model, methods interleaved prompt by prompt on the same weights "
            "(the GGUF file, de-quantized to the compute dtype for both swiftk and transformers). "
            "tok/s = generated tokens / wall time over all prompts; × = ratio of tok/s; M = tokens per verify pass; "
            "α = accepted / drafted tokens; opt = share of wall time spent optimizing the skip set. "
            "`swift-cold` starts from a fresh optimizer (its optimization time included), `swift-warm` loads the "
            "skip set a tuning pass over the same prompts found, `swift-saved` decodes with a fixed skip set from "
            "a file (the Self-SD comparison: a set `swiftk optimize` found offline on other prompts), "
            "`swiftk-ee<E>` is swiftk's early-exit drafting from layer E (KVQ cache on), `hf-ee<E>` is "
            "transformers' early-exit self-speculation drafting with E layers, `hf-pld` prompt-lookup "
            "decoding.", ""]
    for path, s in items:
        meta = s["meta"]
        mach = meta["machine"]
        out.append(f"### {meta['model']} — {meta['dtype']}, {mach['device_name']} "
                   f"({mach['cores']} cores, {mach['threads']} threads), torch {mach['torch']}, "
                   f"transformers {mach.get('transformers', '?')}, {meta['max_new_tokens']} new tokens, "
                   f"{meta['date'][:10]}")
        out.append("")
        for w, groups in s["results"].items():
            cell = groups["all"]
            n = next(iter(cell.values()))["prompts"]
            out.append(f"**{w}** ({n} prompts)")
            out.append("")
            out.append("| method | tok/s | × HF greedy | × swiftk AR | × best HF | M | α | opt |")
            out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
            for m in _order(cell):
                c = cell[m]
                out.append(f"| {m} | {_f(c['tokens_per_s'], '{:.1f}')} | {_f(c['speedup_vs_hf_greedy'])} | "
                           f"{_f(c['speedup_vs_swiftk_ar'])} | {_f(c.get('speedup_vs_best_hf'))} | {_f(c['M'])} | "
                           f"{_f(c['alpha'])} | {_f(c['opt_share'], '{:.0%}')} |")
            out.append("")
        rf = s.get("roofline") or {}
        if rf.get("workloads"):
            w0, v0 = next(iter(rf["workloads"].items()))
            out.append(f"swiftk autoregressive reads its weights at {v0['ar_weight_gb_s']:.2f} GB/s ({w0}), "
                       f"{v0['fraction_of_copy_bw']:.0%} of the measured copy bandwidth "
                       f"({rf['copy_bandwidth_gb_s']:.1f} GB/s).")
            out.append("")
        mm = s.get("mismatches") or []
        if mm:
            out.append(f"Losslessness: **{len(mm)} mismatch(es)** against {meta['reference']} (method, prompt, "
                       "first differing token): " + "; ".join(
                           f"{x['method']} {x['prompt']} @{x['first_diff']}" for x in mm) + ".")
        else:
            out.append(f"Losslessness: every method produced exactly the token ids of {meta['reference']} "
                       "on every prompt.")
        unavailable = meta.get("unavailable") or {}
        if unavailable:
            out.append("")
            out.append("Not run: " + "; ".join(f"{k} ({v})" for k, v in unavailable.items()) + ".")
        if meta.get("skip_set_file"):
            out.append("")
            out.append(f"swift-saved skip set: `{meta['skip_set_file']}`.")
        out.append("")
        out.append(f"Reproduce (`{path.name}`): `{meta['command']}`")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--device-kind", default=None, help="only results of this device kind (cpu, cuda-h100-...)")
    ap.add_argument("--model", action="append", default=None, help="only these models (repeatable)")
    a = ap.parse_args(argv)
    print(render(latest_summaries(Path(a.results), a.device_kind, a.model)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
