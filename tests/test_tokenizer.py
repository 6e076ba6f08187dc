"""Tokenizer built from GGUF metadata vs transformers' tokenizer built from the same file."""
import pytest

from swiftk.errors import SwiftkError
from swiftk.loading.loaders import read_gguf
from swiftk.loading.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "def f(x):\n    return x * 2\n\n\tif x:\n\t\tpass\n",
    "  leading and trailing spaces  ",
    "12345 and 3.14159 and 1,000,000",
    "héllo wörld ñ 日本語のテキスト",
    "emoji 😀🎉👍🏽 done",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "\n\n\nnewlines\r\n\r\n",
    "I'm sure you're right; we'LL see what they've done",
    "a" * 50,
    "   ",
    "<|endoftext|>x<|im_end|>",
    "for i in range(10):\n        print(i)  # comment",
    "x=[1,2,3];y={'a':1}",
    "mixed\u00a0nbsp and\u2003emspace",
    "The date 2024-01-15 at 12:30:45",
    "    \n    \n",
    "https://example.com/a?b=1&c=2",
    "ALLCAPS and CamelCase and snake_case",
]


@pytest.fixture(scope="module")
def ours(smollm2_path):
    meta = read_gguf(smollm2_path).metadata
    return Tokenizer.from_gguf_metadata({k: v for k, v in meta.items() if k.startswith("tokenizer.")})


@pytest.fixture(scope="module")
def theirs(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(ours, theirs, text):
    assert ours.encode(text, add_bos=False) == theirs.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(ours, text):
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_special_tokens_are_single_ids(ours):
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = ours.encode(f"a{t}b", add_bos=False)
        assert ours.token_to_id(t) in ids and len(ids) == 3, t
        assert ours.token_to_id(t) in ours.special_ids
    # skip_special_tokens drops them when decoding
    assert ours.decode(ours.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_bos_eos_and_flags(ours, theirs):
    assert ours.vocab_size == 49152
    assert ours.bos_id == ours.token_to_id("<|im_start|>")  # SmolLM2's GGUF says bos = 1
    assert ours.add_bos is False  # tokenizer.ggml.add_bos_token is false in this file
    assert ours.encode("hi")[0] != ours.bos_id
    assert ours.encode("hi", add_bos=True)[0] == ours.bos_id
    im_end = ours.token_to_id("<|im_end|>")
    assert im_end in ours.eos_ids and theirs.convert_tokens_to_ids("<|im_end|>") == im_end


def test_chat_template_matches_transformers(ours, theirs):
    msgs = [{"role": "user", "content": "Write a haiku about tests."}]
    got = ours.apply_chat_template(msgs, add_generation_prompt=True)
    assert got == theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "Write a haiku about tests." in got and got.endswith("<|im_start|>assistant\n")
    two = ours.apply_chat_template(msgs + [{"role": "assistant", "content": "ok"}], add_generation_prompt=False)
    assert two.endswith("ok<|im_end|>\n")


def test_template_errors_are_swiftk_errors():
    from tokenizers import Tokenizer as HFTok, models

    tok = Tokenizer(HFTok(models.BPE()), bos_id=None, eos_id=None, add_bos=False,
                    chat_template="{{ raise_exception('no system role') }}", vocab_size=0, special_ids=())
    with pytest.raises(SwiftkError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    tok.chat_template = None
    with pytest.raises(SwiftkError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_non_bpe_gguf_tokenizer_rejected():
    with pytest.raises(SwiftkError, match="unsupported GGUF tokenizer model 'llama'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})


@pytest.mark.parametrize("pre,text,pieces", [
    # single digits (smollm, qwen2) vs groups of up to three (llama3)
    ("smollm", "x 12345", ["x", "Ġ", "1", "2", "3", "4", "5"]),
    ("qwen2", "x 12345", ["x", "Ġ", "1", "2", "3", "4", "5"]),
    ("llama-bpe", "x 12345", ["x", "Ġ", "123", "45"]),
    ("gpt2", "x 12345", ["x", "Ġ12345"]),
])
def test_pre_tokenizer_splits(pre, text, pieces):
    from swiftk.loading.tokenizer import _pre_tokenizer_for

    got = [p for p, _ in _pre_tokenizer_for(pre).pre_tokenize_str(text)]
    assert got == pieces


def test_qwen2_tokenizer_matches_transformers_if_cached():
    """Qwen2.5 uses the 'qwen2' split; checked when the model is already in the cache (too big to pull in CI)."""
    from swiftk.loading import registry

    info = registry.model_info("qwen2.5-coder-0.5b")
    if not info["cached"]:
        pytest.skip("qwen2.5-coder-0.5b not in $SWIFTK_HOME")
    transformers = pytest.importorskip("transformers")
    from pathlib import Path

    p = Path(info["path"])
    meta = read_gguf(p).metadata
    ours = Tokenizer.from_gguf_metadata({k: v for k, v in meta.items() if k.startswith("tokenizer.")})
    theirs = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    assert {ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")} <= ours.eos_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
