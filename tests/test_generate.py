"""Autoregressive generation on real SmolLM2-135M weights against Hugging Face transformers, plus API behaviour."""
import json
import subprocess
import sys

import pytest
import torch

import swiftk
from swiftk.errors import SwiftkError

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Write a haiku about the sea.\n",
    "import numpy as np\n\ndef softmax(x):\n    \"\"\"Numerically stable softmax.\"\"\"\n",
    "Once upon a time, in a small village,",
    "Q: What is 17 * 23?\nA:",
]


@pytest.fixture(scope="module")
def eng(smollm2_path):
    # float32 activations: the de-quantized model transformers runs (the int8 default is a slightly different one)
    return swiftk.load(str(smollm2_path), device="cpu", dtype="float32", activations="float32")


@pytest.fixture(scope="module")
def hf(smollm2_path):
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32)
    return m.eval()


def test_logits_match_transformers_real_weights(eng, hf):
    long_text = " ".join(PROMPTS) * 4  # > 100 tokens: RoPE at larger positions
    for text in PROMPTS[:3] + [long_text]:
        ids = eng.tokenizer.encode(text)
        ours = eng.logits(ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        err = (ours - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), (text[:30], len(ids), err)
    assert len(eng.tokenizer.encode(long_text)) > 100


def test_greedy_identical_to_transformers_generate(eng, hf):
    for text in PROMPTS[:5]:
        ids = eng.tokenizer.encode(text)
        out = eng.generate(ids, max_new_tokens=64, method="autoregressive")
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, num_beams=1,
                              eos_token_id=sorted(eng.tokenizer.eos_ids), pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == ref, text
        assert out.stats["new_tokens"] == len(ref)


def test_sampling_reproducible_with_seed(eng):
    a = eng.generate("Tell me a story:", max_new_tokens=24, method="autoregressive", temperature=0.9, top_p=0.9, seed=7)
    b = eng.generate("Tell me a story:", max_new_tokens=24, method="autoregressive", temperature=0.9, top_p=0.9, seed=7)
    c = eng.generate("Tell me a story:", max_new_tokens=24, method="autoregressive", temperature=0.9, top_p=0.9, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_and_streaming(eng):
    pieces = []
    full = eng.generate("def add(a, b):", max_new_tokens=40, method="autoregressive")
    words = [w for w in full.text.split() if len(w) >= 3]
    stop = words[len(words) // 2]  # a string the model really produces, mid-way
    cut = full.text.find(stop)
    out = eng.generate("def add(a, b):", max_new_tokens=40, method="autoregressive", stop=[stop],
                       callback=pieces.append)
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert "".join(pieces) == out.text
    streamed = list(eng.stream("def add(a, b):", max_new_tokens=20, method="autoregressive"))
    assert "".join(streamed) == eng.generate("def add(a, b):", max_new_tokens=20, method="autoregressive").text


def test_eos_stops_generation(eng):
    out = eng.generate("Hi!", chat=True, max_new_tokens=200, method="autoregressive")
    assert out.finish_reason in ("eos", "length")
    if out.finish_reason == "eos":
        assert out.token_ids[-1] in eng.tokenizer.eos_ids
    assert out.stats["tokens_per_s"] > 0


@pytest.mark.parametrize("kw,msg", [
    (dict(prompt=""), "empty"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=10**6), "exceeds the context"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(method="beam"), "unknown method"),
    (dict(skip_ratio=1.2), "skip_ratio"),
    (dict(eps=2.0), "eps"),
    (dict(context_window=0), "context_window"),
    (dict(max_draft=0), "max_draft"),
    (dict(bogus=1), "unknown option"),
])
def test_bad_generate_input(eng, kw, msg):
    kw = dict(kw)
    prompt = kw.pop("prompt", "hello")
    with pytest.raises(SwiftkError, match=msg):
        eng.generate(prompt, **kw)


def test_bad_load_input(smollm2_path):
    with pytest.raises(SwiftkError, match="known model"):
        swiftk.load("no-such-model")
    with pytest.raises(SwiftkError, match="dtype"):
        swiftk.load(str(smollm2_path), dtype="int3")
    with pytest.raises(SwiftkError, match="device"):
        swiftk.load(str(smollm2_path), device="tpu")
    with pytest.raises(ValueError):  # SwiftkError is a ValueError
        swiftk.load(str(smollm2_path), max_context=10**9)


def test_module_generate_caches_engine(smollm2_path):
    a = swiftk.generate("1, 2, 3,", model=str(smollm2_path), max_new_tokens=8, method="autoregressive")
    b = swiftk.generate("1, 2, 3,", model=str(smollm2_path), max_new_tokens=8, method="autoregressive")
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    assert len(swiftk.api._engines) >= 1


def test_cli_generate_json(smollm2_path):
    r = subprocess.run([sys.executable, "-m", "swiftk.cli", "generate", "def f(x):", "--model", str(smollm2_path),
                        "-n", "12", "--method", "swift", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["new_tokens"] == 12
    for key in ("mean_accepted_length", "acceptance_rate", "skip_set", "time_draft_s", "decoding_steps"):
        assert key in out["stats"]
    r = subprocess.run([sys.executable, "-m", "swiftk.cli", "generate", "x", "--model", "nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "known model" in r.stderr


def test_text_is_decoded_once_without_stop_strings_or_a_stream():
    """Decoding every prefix made a call O(n^2) in its length; without a stop string or a stream the text is
    decoded when read, and is the same text."""
    from swiftk.decoding.output import TokenSink

    class Tok:
        eos_ids = {0}
        calls = 0

        def decode(self, ids):
            Tok.calls += 1
            return "".join(f"w{i} " for i in ids)

    ids = list(range(5, 105))
    sink = TokenSink(Tok(), 1000)
    sink.extend(ids)
    assert Tok.calls == 0 and sink.text == Tok().decode(ids) and Tok.calls == 2
    assert sink.text == Tok().decode(ids) and Tok.calls == 3          # read again: not decoded again
    Tok.calls = 0
    stopped = TokenSink(Tok(), 1000, stop=["w50 "])
    assert stopped.extend(ids) and stopped.finish_reason == "stop"
    assert stopped.text == Tok().decode(range(5, 50)) and Tok.calls == 46 + 1


def test_streamed_and_stopped_text_decodes_incrementally(eng):
    """Streams and stop strings follow the text token by token through the tokenizer's incremental decoder (not
    a decode of every prefix); the pieces join to the full decode, multi-byte characters included, and a stop
    string cuts where it does in the full text."""
    from swiftk.decoding.output import TokenSink

    tok = eng.tokenizer
    text = "def f(x):\n    return x  # héllo wörld ✓ 日本語 🙂 «q» — …\n" * 8
    ids = tok.encode(text, add_bos=False)
    full = tok.decode(ids)
    calls = []

    class Counting:   # the engine's tokenizer, its full decodes counted
        eos_ids = tok.eos_ids

        def decode(self, x):
            calls.append(len(x))
            return tok.decode(x)

        def decode_stream(self):
            return tok.decode_stream()

    pieces = []
    sink = TokenSink(Counting(), len(ids), callback=pieces.append)
    sink.extend(ids)
    assert sink.finish_reason == "length" and "".join(pieces) == full == sink.text
    assert calls == [len(ids)]   # once, at the end
    calls.clear()
    stop = "日本語 🙂"
    sink = TokenSink(Counting(), 10_000, stop=[stop])
    assert sink.extend(ids) and sink.finish_reason == "stop"
    assert sink.text == full[:full.find(stop)] and calls == []


def test_stop_strings_hold_when_the_decoder_fails_or_rewrites_the_tail():
    """A tokenizer whose incremental decoder raises falls back to full decodes; a full decode that completes a
    character it showed as U+FFFD still finds a stop string that ends in it."""
    from swiftk.decoding.output import TokenSink

    class Tok:   # token 1 = the first byte of "€" (incomplete alone), token 2 = the rest
        eos_ids = {0}

        def decode(self, ids):
            out = ""
            for i, t in enumerate(ids):
                if t == 1:
                    out += "" if i + 1 < len(ids) and ids[i + 1] == 2 else "\ufffd"
                elif t == 2:
                    out += "€" if i and ids[i - 1] == 1 else "\ufffd"
                else:
                    out += f"w{t} "
            return out

        def decode_stream(self):
            seen = []

            def step(t):
                seen.append(t)
                if len(seen) > 2:
                    raise ValueError("Invalid prefix encountered")
                return f"w{t} "
            return step

    sink = TokenSink(Tok(), 100, stop=["€"])
    assert sink.extend([5, 6, 7, 1, 2, 8]) and sink.finish_reason == "stop"
    assert sink.text == "w5 w6 w7 " and sink.ids == [5, 6, 7, 1, 2]
