"""bench/replay.py: the replay loop accepts exactly what agrees with the recorded output, and its drafters'
outcomes reach the sources (a tiny model, no timing claims)."""
import json

import pytest
import torch

import swiftk
from bench import replay as R


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    eng = swiftk.load(str(tiny_dir), persist=False)
    items = [{"id": f"p{i}", "category": "t", "ids": eng.encode_prompt(p)}
             for i, p in enumerate(["w3 w9 w1 w3 w9", "w5 w6 w7 w5 w6 w7"])]
    rows = R.outputs(eng, items, 24, tmp_path_factory.mktemp("replay"))
    costs = R.cost_model(eng, {1: 0.01, 2: 0.0105, 4: 0.011, 8: 0.012, 12: 0.013, 16: 0.014, 24: 0.016, 32: 0.02})
    return eng, rows, costs


class Oracle:
    """Knows each output: proposes its next ``budget - 1`` tokens."""

    def __init__(self, rows):
        self.full = {tuple(r["ids"]): r["ids"] + r["out"] for r in rows}

    def begin(self, prompt):
        self.seq = self.full[tuple(prompt)]

    def propose(self, tokens, budget):
        assert tokens == self.seq[:len(tokens)]
        return [self.seq[len(tokens):len(tokens) + budget - 1]]

    def end(self, output):
        pass


def test_outputs_are_greedy_with_the_targets_top_k(setup):
    eng, rows, _ = setup
    for r in rows:
        ref = eng.generate(r["ids"], max_new_tokens=24, method="autoregressive").token_ids
        assert r["out"] == ref and len(r["topk"]) == len(ref)
        # the top-1 after output token j is output token j+1 (teacher-forced scores of the same model)
        assert [t[0] for t in r["topk"][:-1]] == ref[1:]


def test_an_oracle_fills_every_pass_and_nothing_is_accepted_past_the_output(setup):
    eng, rows, costs = setup
    for budget in (2, 4, 8):
        r = R.replay(eng, R.External(Oracle(rows), budget), rows, costs, budget)
        assert r["plain"] == 0 and r["tokens"] == sum(len(x["out"]) - 1 for x in rows)
        full = sum((len(x["out"]) - 1) // budget for x in rows)        # passes that could use the whole budget
        assert r["accepted"] + r["passes"] >= r["tokens"] and r["passes"] <= full + len(rows)
        assert r["tokens_per_pass"] > budget - 1


def test_a_drafter_that_proposes_nothing_replays_as_plain_steps(setup):
    eng, rows, costs = setup

    class Nothing(Oracle):
        def propose(self, tokens, budget):
            return []

    r = R.replay(eng, R.External(Nothing(rows), 8), rows, costs, 8)
    assert r["passes"] == 0 and r["plain"] == r["tokens"] and r["predicted_speedup"] <= 1.0


def test_our_sources_learn_from_the_replay(setup):
    eng, rows, costs = setup
    d = R.Ours(eng, {})
    r = R.replay(eng, d, rows * 2, costs)   # the second copy of each output can be drafted from history
    assert r["passes"] > 0 and r["accepted"] > 0
    assert "history" in d.state.estimates and (d.state.successors(eng.config.vocab_size).table >= 0).any()


def test_a_given_cost_table_is_parsed_and_bad_ones_are_refused():
    t = R.parse_costs("8.0, 2:1.04, 8:1.5")
    assert t == pytest.approx({1: 0.008, 2: 0.00832, 8: 0.012})
    for bad in ("8.0", "0,2:1.1", "8.0,2:0.5", "8.0,1:1.2", "fast,2:1.1", "8.0,2"):
        with pytest.raises(SystemExit):
            R.parse_costs(bad)


def test_a_prediction_as_wall_time_charges_the_prefill_to_both_sides(tmp_path):
    assert R.with_prefill(2.0, 0.0) == pytest.approx(2.0)
    assert R.with_prefill(3.0, 1.0) == pytest.approx(1.0)
    assert R.with_prefill(2.0, 0.2) == pytest.approx(1.0 / 0.6)             # (0.2 + 0.8) / (0.2 + 0.4)
    assert R.with_prefill(2.0, 0.2, scale=0.5) == pytest.approx(0.9 / 0.5)  # a prefill twice as fast
    run = {"runs": [{"workload": "edit", "swiftk-ar": {"prefill_s": 1.0, "wall_s": 4.0}},
                    {"workload": "edit", "swiftk-ar": {"prefill_s": 0.0, "wall_s": 6.0}},
                    {"workload": "chat", "swiftk-ar": {"prefill_s": 0.5, "wall_s": 2.0}}]}
    f = tmp_path / "run.json"
    f.write_text(json.dumps(run))
    assert R.prefill_share(str(f)) == pytest.approx({"edit": 0.1, "chat": 0.25})
    (tmp_path / "bad.json").write_text("{\"runs\": [{\"workload\": \"x\"}]}")
    for bad in (tmp_path / "bad.json", tmp_path / "missing.json"):
        with pytest.raises(SystemExit):
            R.prefill_share(str(bad))
