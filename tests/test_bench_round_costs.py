"""bench.round_costs: the split of the default's decode time against autoregressive's adds up, and bad arguments
stop it before a model loads."""
import pytest

from bench.round_costs import main, summarize


def test_the_split_adds_up_to_the_default_s_time():
    # AR: 100 tokens in 1.0 s (10 ms a step). Default: 50 tokens from plain steps (0.52 s), 50 from verify rounds
    # (0.33 s), 0.06 s of host work besides: 0.91 s in all.
    tot = {"ar_s": 1.0, "ar_tokens": 100, "def_s": 0.91, "def_tokens": 100, "plain_s": 0.52, "plain_n": 50,
           "timed_s": 0.85}
    steps = [("plain", 0.010, 0.001), ("plain", 0.011, 0.003), ("verify", 0.012, 0.002)]
    r = summarize(tot, steps)
    sh = r["shares_of_ar_decode"]
    assert sh["verify_saved"] == pytest.approx(0.17)   # 50 tokens at 10 ms = 0.5 s, in 0.33 s
    assert sh["plain_excess"] == pytest.approx(0.02)   # 50 steps took 0.52 s, not 0.50
    assert sh["host"] == pytest.approx(0.06)
    assert 1.0 - sh["verify_saved"] + sh["plain_excess"] + sh["host"] == pytest.approx(tot["def_s"] / tot["ar_s"])
    assert r["decode_ratio"] == pytest.approx(1.0 / 0.91) and r["verify_tokens"] == 50
    assert r["plain_step_medians"]["after_plain"]["step_us"] == pytest.approx(10500)
    assert r["plain_step_medians"]["after_verify"]["host_before_us"] == pytest.approx(2000)


@pytest.mark.parametrize("args, what", [(["--reps", "0"], "--reps"), (["--n", "0"], "--n"),
                                        (["--max-new-tokens", "1"], "--max-new-tokens")])
def test_bad_arguments_are_rejected_before_anything_loads(monkeypatch, args, what):
    import swiftk
    monkeypatch.setattr(swiftk, "load", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit, match=what):
        main(args)
