"""bench.drafting's repetitions: each prompt's median run per arm, every wall time kept beside it."""
import pytest

from bench.drafting import _median_run, main


def test_the_median_repetition_is_kept_with_every_wall_time():
    runs = [{"tokens": [1, 2], "wall_s": w, "prefill_s": w / 10} for w in (0.30, 0.10, 0.20)]
    r = _median_run(runs)
    assert r["wall_s"] == 0.20 and r["prefill_s"] == pytest.approx(0.02)   # one repetition's figures, together
    assert r["walls_s"] == [0.30, 0.10, 0.20]
    assert "walls_s" not in _median_run(runs[:1])   # one run: as before --repeat existed


@pytest.mark.parametrize("repeat", ["0", "2", "4"])
def test_repeat_below_one_or_even_is_rejected_before_anything_loads(monkeypatch, repeat):
    """An even count has no middle run (its lower middle was the faster run: a flattering "median")."""
    import swiftk
    monkeypatch.setattr(swiftk, "load", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit, match="--repeat"):
        main(["--repeat", repeat])
