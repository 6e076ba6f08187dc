"""bench.report: docs/performance.md's tables come from the newest summary per model, and say what it ran."""
import json

from bench import report


def _summary(date, tok_s, mismatches=(), skip_set_file=None):
    cell = lambda t, m=None: {"prompts": 2, "tokens_per_s": t, "speedup_vs_hf_greedy": t / 10.0,  # noqa: E731
                              "speedup_vs_swiftk_ar": t / 10.0, "speedup_vs_best_hf": t / 10.0,
                              "M": m, "alpha": None if m is None else 0.5, "opt_share": None}
    return {
        "meta": {"model": "tiny", "device_kind": "cpu", "dtype": "float32", "date": date, "max_new_tokens": 16,
                 "reference": "hf-greedy", "command": "python -m bench.e2e --model tiny",
                 "skip_set_file": skip_set_file, "unavailable": {"hf-ee": "no transformers"},
                 "machine": {"device_name": "cpu", "cores": 2, "threads": 2, "torch": "x", "transformers": "y"}},
        "results": {"humaneval": {"all": {"swiftk-ee3": cell(4.0, 1.5), "hf-greedy": cell(10.0),
                                          "swiftk-ar": cell(10.0, 1.0), "swift-saved": cell(tok_s, 2.0)}}},
        "mismatches": list(mismatches),
    }


def test_newest_summary_per_model_is_rendered(tmp_path):
    (tmp_path / "a.summary.json").write_text(json.dumps(_summary("2026-01-01T00:00:00", 7.0)))
    (tmp_path / "b.summary.json").write_text(json.dumps(_summary("2026-02-01T00:00:00", 13.0,
                                                                 skip_set_file="sets/x.json")))
    (tmp_path / "broken.summary.json").write_text("{")
    items = report.latest_summaries(tmp_path)
    assert [p.name for p, _ in items] == ["b.summary.json"]
    text = report.render(items)
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| method")]
    # baselines first, then swiftk's own methods, early exit last
    assert [r.split(" | ")[0][2:] for r in rows] == ["hf-greedy", "swiftk-ar", "swift-saved", "swiftk-ee3"]
    assert "| swift-saved | 13.0 | 1.30 |" in text
    assert "swift-saved skip set: `sets/x.json`" in text
    assert "every method produced exactly the token ids of hf-greedy" in text
    assert "Not run: hf-ee (no transformers)" in text
    assert "Reproduce (`b.summary.json`): `python -m bench.e2e --model tiny`" in text


def test_mismatches_are_reported_loudly(tmp_path):
    s = _summary("2026-01-01T00:00:00", 7.0,
                 mismatches=[{"method": "swift-saved", "prompt": "HumanEval/0", "first_diff": 5}])
    (tmp_path / "a.summary.json").write_text(json.dumps(s))
    text = report.render(report.latest_summaries(tmp_path))
    assert "**1 mismatch(es)**" in text and "swift-saved HumanEval/0 @5" in text
    assert report.render([]).startswith("## Performance")


def test_a_later_run_of_one_workload_does_not_hide_the_others(tmp_path):
    full = _summary("2026-01-01T00:00:00", 7.0)
    full["results"]["mtbench"] = full["results"]["humaneval"]
    stream = _summary("2026-02-01T00:00:00", 9.0)
    stream["results"] = {"domain_shift": stream["results"]["humaneval"]}
    newer_he = _summary("2026-03-01T00:00:00", 11.0)
    (tmp_path / "full.summary.json").write_text(json.dumps(full))
    (tmp_path / "stream.summary.json").write_text(json.dumps(stream))
    (tmp_path / "he.summary.json").write_text(json.dumps(newer_he))
    got = {p.name: list(s["results"]) for p, s in report.latest_summaries(tmp_path)}
    assert got == {"full.summary.json": ["mtbench"], "stream.summary.json": ["domain_shift"],
                   "he.summary.json": ["humaneval"]}
