"""A short soak of `swiftk serve` (bench/soak.py's, in CI): 8 clients, 40 requests of mixed lengths, streamed and
not, some sampled, some abandoned. No request fails, every finished answer equals the same request decoded alone,
the server's memory does not grow once its batch slots exist, and it exits without a traceback."""
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import swiftk  # noqa: E402
from bench import soak  # noqa: E402


def test_a_short_soak_is_clean(smollm2_path):
    reqs = soak.plan(40, seed=3, max_tokens=48)
    eng = swiftk.load(str(smollm2_path), persist=False)
    ref = soak.references(eng, reqs)
    for r in reqs:
        if r["abandon"] is None:
            ref(r)
    del eng
    proc, url = soak.start_server(str(smollm2_path), "--max-batch", "8")
    try:
        soak.run(url, proc.pid, soak.plan(8, seed=4, max_tokens=16), 8, lambda r: (None, None))   # warm
        report = soak.run(url, proc.pid, reqs, 8, ref)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert report["errors"] == [] and report["wrong"] == [], report
    assert report["greedy_equal"].split("/")[1] != "0" and report["sampled_equal"].split("/")[1] != "0", report
    assert report["rss_mb_end"] - report["rss_mb_start"] < 64, report   # memory, not time: no leak per request
    assert "Traceback" not in err, err[-3000:]
