"""bench.serve_load: its options are checked before any server starts, and a run without a reference says so
instead of counting every answer unequal."""
import pytest

from bench.serve_load import _equal, main, summarize


@pytest.mark.parametrize("argv, msg", [(["--workloads", "humaneval,poems"], "--workloads"),
                                       (["--workloads", ""], "--workloads"),
                                       (["--reps", "2"], "--reps must be odd")])
def test_bad_options_are_rejected_before_anything_runs(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        main(argv)


def test_equal_counts_against_the_reference_or_says_there_is_none():
    ph = {"wall_s": 2.0, "errors": [], "requests": [
        {"id": "a", "text": "x", "tokens": 3, "latency_s": 1.0, "ttft_s": 0.1},
        {"id": "b", "text": "y", "tokens": 5, "latency_s": 2.0, "ttft_s": 0.2}]}
    s = summarize(ph, {"a": "x", "b": "z"})
    assert (s["tok_s"], s["equal"], s["n"]) == (4.0, 1, 2)
    assert _equal([s]) == "1/2"
    assert _equal([summarize(ph, {})]) == "n/a (no 1-client run)"
