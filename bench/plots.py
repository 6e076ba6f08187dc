"""Plots for bench.e2e results (matplotlib, Agg backend, PNG files written atomically).

- ``<tag>_<workload>_matchness.png``: like the SWIFT paper's Fig. 6 -- matchness of each proposed skip set and the
  cumulative speedup of swift-cold over swiftk-ar (at prompt ends) against tokens generated in the stream.
- ``<tag>_<workload>_categories.png``: speedup vs HF greedy per category and method.
- ``<tag>_domain_shift_acceptance.png``: per-prompt acceptance rate of the SWIFT variants over the domain-shift
  stream, with category boundaries.

``python -m bench.plots RESULTS.summary.json`` redraws them from a summary and its ``.samples.jsonl``.
"""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

COLD, WARM, AR, HF_GREEDY = "swift-cold", "swift-warm", "swiftk-ar", "hf-greedy"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    from swiftk.atomic import write_atomic as atomic_write

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return atomic_write(path, buf.getvalue())


def _runs_of(runs, workload, method):
    return sorted((r for r in runs if r["workload"] == workload and r["method"] == method),
                  key=lambda r: r["stream_index"])


def matchness_plot(out_dir, tag, workload, runs):
    cold, ar = _runs_of(runs, workload, COLD), _runs_of(runs, workload, AR)
    if not cold:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    pts = [p for r in cold for p in (r.get("matchness_history") or [])]
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, alpha=0.5,
                   c=["tab:orange" if p[2] == "bo" else "tab:blue" for p in pts], label="matchness (proposal)")
        best, run_best = [], -1.0
        for p in pts:
            run_best = max(run_best, p[1])
            best.append(run_best)
        ax.plot([p[0] for p in pts], best, color="tab:blue", lw=1.5, label="best matchness")
    ax.set_xlabel("tokens generated in the stream")
    ax.set_ylabel("matchness")
    ax.set_ylim(0, 1.02)
    if ar:
        ax2 = ax.twinx()
        xs, ys, ct, cw, at, aw = [], [], 0, 0.0, 0, 0.0
        by_idx = {r["stream_index"]: r for r in ar}
        for r in cold:
            a = by_idx.get(r["stream_index"])
            if a is None:
                continue
            ct, cw, at, aw = ct + r["new_tokens"], cw + r["wall_time_s"], at + a["new_tokens"], aw + a["wall_time_s"]
            if cw > 0 and at > 0:
                xs.append(ct)
                ys.append((ct / cw) / (at / aw))
        ax2.plot(xs, ys, color="tab:red", marker="o", ms=3, label="cumulative speedup vs swiftk-ar")
        ax2.axhline(1.0, color="tab:red", lw=0.5, ls=":")
        ax2.set_ylabel("cumulative speedup", color="tab:red")
        ax2.legend(loc="lower right", fontsize=8)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title(f"{workload}: swift-cold optimization ({tag})", fontsize=9)
    return _save(fig, Path(out_dir) / f"{tag}_{workload}_matchness.png")


def category_plot(out_dir, tag, workload, groups):
    cats = [g for g in groups if g != "all"]
    if len(cats) < 2:  # one category: the summary table says it all
        return None
    base, key = ((HF_GREEDY, "speedup_vs_hf_greedy") if HF_GREEDY in groups["all"]
                 else (AR, "speedup_vs_swiftk_ar"))
    methods = [m for m in groups["all"] if m != base]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) + 2), 4))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        ys = [(groups[c].get(m) or {}).get(key) or 0 for c in cats]
        ax.bar([i + j * width for i in range(len(cats))], ys, width, label=m)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"speedup vs {base}")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"{workload} per category ({tag})", fontsize=9)
    return _save(fig, Path(out_dir) / f"{tag}_{workload}_categories.png")


def domain_shift_plot(out_dir, tag, runs):
    series = {m: _runs_of(runs, "domain_shift", m) for m in (COLD, WARM, "swift-saved")}
    series = {m: rs for m, rs in series.items() if rs}
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4))
    for m, rs in series.items():
        ax.plot([r["stream_index"] for r in rs],
                [(r["accepted"] / r["drafted"]) if r.get("drafted") else 0 for r in rs], marker=".", label=m)
    first = next(iter(series.values()))
    prev = None
    for r in first:
        if r["category"] != prev:
            ax.axvline(r["stream_index"] - 0.5, color="grey", lw=0.5)
            ax.text(r["stream_index"] - 0.4, 1.0, r["category"], fontsize=7, rotation=90, va="top")
            prev = r["category"]
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("prompt in the stream")
    ax.set_ylabel("acceptance rate α")
    ax.legend(fontsize=8)
    ax.set_title(f"domain shift: acceptance over the stream ({tag})", fontsize=9)
    return _save(fig, Path(out_dir) / f"{tag}_domain_shift_acceptance.png")


def expected_vs_measured_plot(out_dir, tag, workload, runs):
    """Per speculative round of swift-cold: the gate's expected tokens/s against the measured tokens/s."""
    pts = [p for r in _runs_of(runs, workload, COLD) for p in (r.get("expected_vs_measured") or [])]
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=5, alpha=0.4)
    hi = max(max(p[0] for p in pts), max(p[1] for p in pts))
    ax.plot([0, hi], [0, hi], color="gray", lw=1, ls="--", label="expected = measured")
    ax.set_xlabel("expected tokens/s of the round (cost model + acceptance statistics)")
    ax.set_ylabel("measured tokens/s of the round")
    ax.set_title(f"{tag} {workload}: swift-cold rounds")
    ax.legend(loc="upper left", fontsize=8)
    return _save(fig, Path(out_dir) / f"{tag}_{workload}_expected_vs_measured.png")


def plot_all(out_dir, tag, summary, runs) -> list:
    paths = []
    for w, groups in summary["results"].items():
        paths.append(expected_vs_measured_plot(out_dir, tag, w, runs))
        paths.append(matchness_plot(out_dir, tag, w, runs))
        paths.append(category_plot(out_dir, tag, w, groups))
    if "domain_shift" in summary["results"]:
        paths.append(domain_shift_plot(out_dir, tag, runs))
    return [p for p in paths if p is not None]


def _samples_to_runs(path: Path) -> list:
    runs = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        s = json.loads(line)
        c = s["choices"][0]
        alpha = s.get("alpha")
        drafted = 1000000 if alpha is not None else 0  # only the ratio matters for the plots
        runs.append({"workload": s["workload"], "method": s["method"], "stream_index": s["stream_index"],
                     "category": s["category"], "new_tokens": c["new_tokens"][0], "wall_time_s": c["wall_time"][0],
                     "matchness_history": s.get("matchness_history"), "drafted": drafted,
                     "accepted": (alpha or 0) * drafted})
    return runs


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].endswith(".summary.json"):
        print("usage: python -m bench.plots RESULTS.summary.json", file=sys.stderr)
        return 2
    sp = Path(argv[0])
    summary = json.loads(sp.read_text())
    tag = summary["meta"]["tag"]
    runs = _samples_to_runs(sp.with_name(f"{tag}.samples.jsonl"))
    for p in plot_all(sp.parent, tag, summary, runs):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
