"""A smaller model as the drafter (swiftk.load(..., draft_model=...)): lossless against plain decoding, drafts
accepted where the draft agrees, refused where the vocabularies differ."""
import json
import shutil

import pytest

import swiftk
from swiftk import SwiftkError


def _save_llama(d, vocab: int, layers: int, seed: int, scale: float = 6.0):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(scale)
    hf.save_pretrained(d, safe_serialization=True)


@pytest.fixture(scope="module")
def draft_dir(tiny_dir, tmp_path_factory):
    """Another model on tiny_dir's tokenizer: 2 layers, other weights."""
    d = tmp_path_factory.mktemp("tiny-draft")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / f, d / f)
    _save_llama(d, json.loads((tiny_dir / "config.json").read_text())["vocab_size"], 2, seed=1)
    return d


PROMPTS = ["w1 w2 w3 w4 w1 w2 w3", "w10 w11 w12 w13 w14", "w5 w5 w5 w6 w7 w5 w5"]


@pytest.mark.parametrize("speculate", ["auto", "always"])
def test_greedy_output_is_the_targets_whatever_the_draft(tiny_dir, draft_dir, speculate):
    ref = swiftk.load(str(tiny_dir), persist=False)
    eng = swiftk.load(str(tiny_dir), persist=False, draft_model=str(draft_dir), speculate=speculate)
    assert eng.default_method == "draft_model" and eng.info()["draft_model"]["weight_ratio"] < 1.0
    for p in PROMPTS * 2:   # twice: the draft's cache from the call before is reused where it matches
        want = ref.generate(p, max_new_tokens=40, method="autoregressive").token_ids
        got = eng.generate(p, max_new_tokens=40)
        assert got.token_ids == want
        assert got.stats.method == "draft_model"


def test_a_draft_that_agrees_is_accepted(tiny_dir):
    """The target as its own draft: every drafted spine token is the target's, so rounds accept long chains."""
    ref = swiftk.load(str(tiny_dir), persist=False)
    eng = swiftk.load(str(tiny_dir), persist=False, draft_model=str(tiny_dir), speculate="always", ngram=False,
                      history=False, recycle=False, datastore=False)
    for p in PROMPTS:
        want = ref.generate(p, max_new_tokens=48, method="autoregressive").token_ids
        got = eng.generate(p, max_new_tokens=48)
        assert got.token_ids == want
        st = got.stats
        assert st.accepted_by_source["draft"] > 0
        assert st.decoding_steps < len(want) * 0.7, (st.decoding_steps, len(want))


def test_seeded_sampling_matches_plain_decoding(tiny_dir, draft_dir):
    ref = swiftk.load(str(tiny_dir), persist=False)
    eng = swiftk.load(str(tiny_dir), persist=False, draft_model=str(draft_dir), speculate="always")
    for seed in (1, 2, 3):
        kw = dict(max_new_tokens=40, temperature=0.8, top_k=20, seed=seed)
        assert eng.generate(PROMPTS[0], **kw).token_ids == \
            ref.generate(PROMPTS[0], method="autoregressive", **kw).token_ids


def test_a_draft_with_another_vocabulary_is_refused(tiny_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"v{i}" for i in range(61)]   # same size, other tokens
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    shutil.copy(tiny_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    _save_llama(tmp_path, len(words), 2, seed=2)
    with pytest.raises(SwiftkError, match="tokenizer"):
        swiftk.load(str(tiny_dir), persist=False, draft_model=str(tmp_path))


def test_a_draft_with_the_same_tokens_and_another_eos_is_taken(tiny_dir, draft_dir, tmp_path):
    """A base model drafting for its chat sibling: same token ids, another end-of-sequence token."""
    for f in draft_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tc = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tc, "eos_token": "<unk>"}))
    ref = swiftk.load(str(tiny_dir), persist=False)
    eng = swiftk.load(str(tiny_dir), persist=False, draft_model=str(tmp_path), speculate="always")
    want = ref.generate(PROMPTS[0], max_new_tokens=24, method="autoregressive").token_ids
    assert eng.generate(PROMPTS[0], max_new_tokens=24).token_ids == want


def test_the_method_needs_a_draft_model_and_the_option_a_name(tiny_dir):
    eng = swiftk.load(str(tiny_dir), persist=False)
    assert eng.default_method == "swift"
    with pytest.raises(SwiftkError, match="draft_model"):
        eng.generate("w1 w2", max_new_tokens=4, method="draft_model")
    with pytest.raises(SwiftkError, match="draft_model must be"):
        swiftk.load(str(tiny_dir), persist=False, draft_model=3)


def test_reduced_head_and_short_window_stay_lossless(tiny_dir, draft_dir):
    """The draft model's frequent-token head (draft_vocab below half the vocabulary) and a catch-up window that
    restarts the draft on the last tokens of a long context: drafts change, the output does not."""
    ref = swiftk.load(str(tiny_dir), persist=False)
    eng = swiftk.load(str(tiny_dir), persist=False, draft_model=str(draft_dir), draft_vocab=16, speculate="always")
    runner = eng.target.resource("draft_model")
    assert runner.head is not None and runner.n_base == 16
    runner.window = 4
    long = " ".join(f"w{3 + i % 7}" for i in range(30))
    for p in (long, PROMPTS[0], long):
        want = ref.generate(p, max_new_tokens=30, method="autoregressive").token_ids
        assert eng.generate(p, max_new_tokens=30).token_ids == want
    assert runner.base > 0


class _Costs:
    step = 1.0

    def v(self, T):   # a verify pass of T tokens, in steps
        return 1.0 + 0.05 * (T - 1)


def test_the_gate_leaves_rounds_to_free_chains_that_do_better_and_probes_the_model():
    from types import SimpleNamespace

    from swiftk.decoding.gate import Gate
    from swiftk.decoding.state import GateMemory
    from swiftk.proposers.base import Chain

    g = Gate(_Costs(), GateMemory(draft_rate=1.5), SimpleNamespace(speculate="auto"))
    strong = [Chain([1, 2, 3, 4], [0.95] * 4, "ngram")]   # 4.52 tokens for a pass of 5: 3.77x a plain step
    weak = [Chain([7], [0.2], "datastore")]               # 1.2 tokens for a pass of 2: 1.14x
    assert g.model_draft_pays([]) and g.model_draft_pays(weak)
    answers = [g.model_draft_pays(strong) for _ in range(12)]
    assert answers == [False] * 3 + [True] + [False] * 7 + [True]   # probes, the gap doubling (4, 8)
    # what free-only rounds measure scales their estimate, for the rounds after (kept in the state's memory)
    g.model_draft_pays(weak)
    g.free_measured(3, 1)   # 3 tokens from a pass of one token: 3.0x a plain step
    assert g.memory.free_bias == pytest.approx(1.0 + 0.2 * (3.0 / (1.2 / 1.05) - 1.0))
    assert not g.model_draft_pays(weak)   # 1.14 x 1.33 > 1.5
    # two sources agreeing on a first token share its node (the larger value), as the tree does
    g2 = Gate(_Costs(), GateMemory(draft_rate=2.0), SimpleNamespace(speculate="auto"))
    g2.model_draft_pays([Chain([1, 2], [0.9, 0.9], "ngram"), Chain([1, 3], [0.5, 0.5], "recycle")])
    assert g2._free_est == pytest.approx(max((1 + 0.9) / 1.05, (1 + 0.9 + 0.81) / 1.1, (1 + 0.9 + 0.81 + 0.45) / 1.15))
    off = Gate(_Costs(), GateMemory(draft_rate=0.5), SimpleNamespace(speculate="always"))
    assert off.model_draft_pays(strong)   # the paper's rule drafts every round


def test_cli_takes_a_draft_model_and_names_what_it_cannot_combine(tiny_dir, draft_dir, capsys):
    from swiftk.cli import main

    assert main(["generate", "w1 w2 w3", "--model", str(tiny_dir), "--draft-model", str(draft_dir), "-n", "8",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["method"] == "draft_model"
    assert main(["generate", "w1 w2", "--model", str(tiny_dir), "--draft-model", str(draft_dir), "--skip-set",
                 "x.json"]) != 0
    assert "--skip-set is an option of --method swift or static, not draft_model" in capsys.readouterr().err


def test_a_new_prompt_restarts_the_draft_on_its_own_tail(tiny_dir, draft_dir, monkeypatch):
    """A prompt sharing nothing with what the draft holds starts its window at its own end, not where the last
    call's did; prefix_cache=False (key-scoped serving) empties the draft's cache first; draft_vocab is the load's."""
    from swiftk.proposers.draft_model import DraftModel

    eng = swiftk.load(str(tiny_dir), persist=False, draft_model=str(draft_dir), speculate="always")
    runner = eng.target.resource("draft_model")
    runner.window = 16
    first = " ".join(f"w{3 + i % 7}" for i in range(40))
    second = " ".join(f"w{20 + i % 5}" for i in range(30))
    eng.generate(first, max_new_tokens=8)
    eng.generate(second, max_new_tokens=8)
    assert runner.base == len(eng.encode_prompt(second)) + 1 - 16
    forgot = []
    monkeypatch.setattr(DraftModel, "forget", lambda self: forgot.append(1))
    eng.generate(second, max_new_tokens=4, prefix_cache=False)
    eng.generate(second, max_new_tokens=4)
    assert forgot == [1]
    with pytest.raises(SwiftkError, match="draft_vocab"):
        eng.generate(second, max_new_tokens=4, draft_vocab=16)


def test_cli_refuses_a_draft_model_method_without_a_draft_model(tiny_dir, draft_dir, capsys):
    from swiftk.cli import main

    assert main(["generate", "w1 w2", "--model", str(tiny_dir), "--method", "draft_model"]) != 0
    assert "--method draft_model needs --draft-model" in capsys.readouterr().err
    assert main(["generate", "w1 w2", "--model", str(tiny_dir), "--draft-model", str(draft_dir),
                 "--save-skip-set", "x.json"]) != 0
    assert "--save-skip-set saves what --method swift optimizes, not draft_model" in capsys.readouterr().err
    assert main(["generate", "w1 w2", "--model", str(tiny_dir), "--draft-model", str(draft_dir), "--method",
                 "swift"]) != 0
    assert "--draft-model drafts for --method draft_model, not swift" in capsys.readouterr().err
    eng = swiftk.load(str(tiny_dir), persist=False, draft_model=str(draft_dir))
    for method in ("draft_model", "ngram"):   # no layer-skip draft whose lower layers kvq could reuse
        with pytest.raises(SwiftkError, match="kvq is an option of the layer-skip methods"):
            eng.generate("w1 w2", max_new_tokens=4, method=method, kvq=True)


def test_the_server_serves_the_engines_default_and_refuses_a_missing_draft_model(tiny_dir, draft_dir):
    pytest.importorskip("fastapi")
    from swiftk.serve.app import Server

    plain = swiftk.load(str(tiny_dir), persist=False)
    with pytest.raises(SwiftkError, match="needs a draft model"):
        Server(plain, "tiny", method="draft_model")
    assert Server(plain, "tiny").method == "swift"
    with pytest.raises(SwiftkError, match="kvq is an option of the layer-skip methods"):   # any method's checks
        Server(plain, "tiny", method="ngram", options={"kvq": True})
    eng = swiftk.load(str(tiny_dir), persist=False, draft_model=str(draft_dir))
    assert Server(eng, "tiny").method == "draft_model"


def test_a_repeated_prompt_reuses_what_the_draft_holds(tiny_dir, draft_dir):
    """The draft's cache from the call before is kept where it matches: the same prompt again feeds the draft its
    root only, not the prompt."""
    eng = swiftk.load(str(tiny_dir), persist=False, draft_model=str(draft_dir), speculate="always")
    runner = eng.target.resource("draft_model")
    fed, forward = [], runner.model.forward
    runner.model.forward = lambda ids, *a, **k: (fed.append(len(ids)), forward(ids, *a, **k))[1]
    p = " ".join(f"w{3 + i % 5}" for i in range(20))
    eng.generate(p, max_new_tokens=12)
    first_call, fed[:] = fed[0], []
    eng.generate(p, max_new_tokens=12)
    assert first_call > len(eng.encode_prompt(p)) and fed[0] == 1


def test_draft_vocab_reaches_the_load_from_generate_cli_and_server(tiny_dir, draft_dir, capsys):
    """draft_vocab sizes the draft model's head at load: swiftk.generate and the CLI pass it there; a server whose
    options differ from its engine's is refused when built, not on every request."""
    from swiftk.cli import main

    ref = swiftk.load(str(tiny_dir), persist=False)
    want = ref.generate(PROMPTS[0], max_new_tokens=16, method="autoregressive").token_ids
    got = swiftk.generate(PROMPTS[0], model=str(tiny_dir), persist=False, draft_model=str(draft_dir),
                          draft_vocab=16, max_new_tokens=16)
    assert got.token_ids == want and got.stats.method == "draft_model"
    assert main(["generate", PROMPTS[0], "--model", str(tiny_dir), "--draft-model", str(draft_dir), "-n", "8",
                 "--swift", "draft_vocab=16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["method"] == "draft_model"
    pytest.importorskip("fastapi")
    from swiftk.serve.app import Server

    eng = swiftk.load(str(tiny_dir), persist=False, draft_model=str(draft_dir), draft_vocab=16)
    assert Server(eng, "tiny", options={"draft_vocab": 16}).method == "draft_model"
    with pytest.raises(SwiftkError, match="draft_vocab"):
        Server(eng, "tiny", options={"draft_vocab": 32})
