"""`swiftk serve` on loopback, driven by OpenAI's own Python client: outputs equal in-process decoding, streaming,
concurrency, every kind of bad request, abandoned streams, the queue bound, API keys and history scopes,
shutdown on SIGTERM."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import swiftk  # noqa: E402

NAME = "smollm2"
PROMPT = "def fibonacci(n):"
MSGS = [{"role": "user", "content": "Name three colours."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """A `swiftk serve` subprocess; ready once /health answers."""

    def __init__(self, model, *args):
        self.port = _free_port()
        env = {**os.environ, "SWIFTK_PERSIST": "0"}
        self.proc = subprocess.Popen([sys.executable, "-m", "swiftk.cli", "serve", "--model", str(model),
                                      "--served-model-name", NAME, "--port", str(self.port),
                                      "--log-level", "warning", *args],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 180   # a hang guard, not a speed bound
        while True:
            assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
            try:
                self.health()
                return
            except OSError:
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.3)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
            return json.loads(r.read())

    def client(self, key="unused"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def post(self, path, body: bytes, headers=None):
        req = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json",
                                                                          **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read()), r.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.communicate()


@pytest.fixture(scope="module")
def ref(smollm2_path):
    eng = swiftk.load(str(smollm2_path), persist=False)
    return {"text": eng.generate(PROMPT, max_new_tokens=24, method="autoregressive").text,
            "chat": eng.generate(MSGS, max_new_tokens=20, chat=True, method="autoregressive").text,
            "max_context": eng.max_context}


@pytest.fixture(scope="module")
def live(smollm2_path):
    srv = Live(smollm2_path)
    yield srv
    _, err = srv.stop()
    assert "Traceback" not in err, err[-3000:]


def test_completion_equals_in_process_greedy(live, ref):
    c = live.client()
    r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == 24 or r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ext = r.model_extra["swiftk"]
    assert ext["method"] == "swift" and ext["tokens_per_s"] > 0 and ext["mean_accepted_length"] >= 1
    # the same prompt as token ids, and as a one-element list
    ids = c.completions.create(model=NAME, prompt=[PROMPT], max_tokens=24, temperature=0)
    assert ids.choices[0].text == ref["text"]
    assert [m.id for m in c.models.list().data] == [NAME]


def test_chat_completion_applies_the_template(live, ref):
    r = live.client().chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == ref["chat"]
    assert r.choices[0].message.role == "assistant"


def test_streaming_chunks_add_up(live, ref):
    c = live.client()
    chunks = list(c.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref["text"]
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    chat = list(c.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chat) == ref["chat"]
    assert chat[-1].choices[0].finish_reason in ("length", "stop")


def test_concurrent_clients_decode_together_with_their_solo_outputs(live, ref):
    """Six clients at once (streamed completions, chats, a plain completion) and one that abandons its stream: they
    share passes (the batch), and every answer equals the same request decoded alone."""
    out, shared, errors = {}, [], []

    def run(i):
        try:
            c = live.client()
            if i == 5:   # gone after two chunks: leaves the batch, nobody else's output changes
                s = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=300, temperature=0,
                                         stream=True)
                for j, _ in enumerate(s):
                    if j == 2:
                        break
                s.close()
            elif i % 2:
                r = c.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=0)
                out[i] = r.choices[0].message.content
                shared.append(r.model_extra["swiftk"]["shared_passes"])
            elif i == 4:
                r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
                out[i] = r.choices[0].text
                shared.append(r.model_extra["swiftk"]["shared_passes"])
            else:
                out[i] = "".join(ch.choices[0].text for ch in c.completions.create(
                    model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stream=True) if ch.choices)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert out == {0: ref["text"], 1: ref["chat"], 2: ref["text"], 3: ref["chat"], 4: ref["text"]}
    assert max(shared) > 0, shared   # at least one answer was decoded in passes with others


@pytest.mark.parametrize("kw, param", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=10**9), "max_tokens"),
    (dict(temperature=5.0), "temperature"),
    (dict(temperature=1e-7), None),
    (dict(top_p=0.0), None),
    (dict(n=0), "n"),
    (dict(n=65), "n"),
    (dict(extra_body={"frequency_penalty": 0.5}), "frequency_penalty"),
    (dict(extra_body={"bogus": 1}), "bogus"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
])
def test_bad_completion_requests_get_400(live, kw, param):
    args = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        live.client().completions.create(**args)
    err = e.value.body
    assert err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


def test_fields_that_ask_nothing_of_the_output_are_accepted(live, ref):
    """OpenAI fields that ask nothing of the tokens are no-ops, not 400s: a message's name, the developer role (the
    system role), an assistant message echoed back with model_dump() (null refusal, tool_calls, audio,
    annotations), store, metadata, service_tier, prompt_cache_key, parallel_tool_calls, user,
    stream_options.include_obfuscation. The output is the one without them."""
    c = live.client()
    first = c.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=0)
    assert first.choices[0].message.content == ref["chat"]
    echoed = first.choices[0].message.model_dump()
    assert "refusal" in echoed and "tool_calls" in echoed
    convo = [{"role": "system", "content": "Be brief."}, {**MSGS[0], "name": "alice"}, echoed,
             {"role": "user", "content": "And in Python?"}]
    plain = [{"role": "system", "content": "Be brief."}, MSGS[0],
             {"role": "assistant", "content": ref["chat"]}, {"role": "user", "content": "And in Python?"}]
    noops = dict(store=False, metadata={"run": "7"}, service_tier="auto", user="u1",
                 extra_body={"prompt_cache_key": "k", "parallel_tool_calls": False})
    want = c.chat.completions.create(model=NAME, messages=plain, max_tokens=12, temperature=0).choices[0]
    got = c.chat.completions.create(model=NAME, messages=convo, max_tokens=12, temperature=0, **noops).choices[0]
    assert got.message.content == want.message.content
    dev = [{"role": "developer", "content": "Be brief."}, *plain[1:]]
    assert c.chat.completions.create(model=NAME, messages=dev, max_tokens=12,
                                     temperature=0).choices[0].message.content == want.message.content
    chunks = list(c.chat.completions.create(model=NAME, messages=plain, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "include_obfuscation": False}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.message.content
    with pytest.raises(openai.BadRequestError) as e:   # the legacy function_call is not a no-op: refused
        c.chat.completions.create(model=NAME, max_tokens=4, messages=[*plain[:2], {
            "role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}}])
    assert e.value.body["param"] == "messages.2.function_call"   # (tool calls: tests/test_serve_tools.py)


def test_n_choices_and_several_prompts_decode_as_requests_of_the_batch(live, ref):
    """n choices of a prompt, and several prompts in one completions request (langchain's .batch()), are requests of
    the batch: each choice is what the same request alone gives (greedy: the solo text; seeded: choice j has the
    seed + j), the usage counts each prompt once, and a stream names each chunk's choice."""
    c = live.client()
    r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and all(ch.text == ref["text"] for ch in r.choices)
    one = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    other = "Once upon a time"
    both = c.completions.create(model=NAME, prompt=[PROMPT, other], max_tokens=12, temperature=0, n=2)
    alone = [c.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0).choices[0].text
             for p in (PROMPT, other)]
    assert [ch.text for ch in both.choices] == [alone[0], alone[0], alone[1], alone[1]]
    seeded = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5, n=2)
    solo = [c.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=s).choices[0].text
            for s in (5, 6)]
    assert [ch.text for ch in seeded.choices] == solo
    chat = c.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=0, n=2)
    assert [ch.message.content for ch in chat.choices] == [ref["chat"]] * 2
    chunks = list(c.completions.create(model=NAME, prompt=[PROMPT, other], max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for x in ch.choices:
            texts[x.index] += x.text
    assert texts == {0: alone[0], 1: alone[1]}
    assert [i for i, ch in enumerate(chunks) if ch.usage is not None] == [len(chunks) - 1]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=NAME, prompt=[PROMPT] * 33, max_tokens=2, n=2)
    assert e.value.body["param"] == "prompt"


def test_logprobs_are_the_targets_with_or_without_streaming(live, ref, smollm2_path):
    """logprobs / top_logprobs in chat and completions, whole and streamed: the engine's (the target's log-softmax
    over the scores that chose each token), in OpenAI's shapes; the stream's chunks add up to the whole."""
    eng = swiftk.load(str(smollm2_path), persist=False)
    want = eng.generate(PROMPT, max_new_tokens=24, method="autoregressive", logprobs=2).logprobs
    c = live.client()
    r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [e["logprob"] for e in want]
    assert "".join(lp.tokens) == r.choices[0].text == ref["text"]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(t) == 2 and max(t.values()) == x for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    chunks = list(c.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=2,
                                       stream=True))
    streamed = [x for ch in chunks for x in (ch.choices[0].logprobs.token_logprobs if ch.choices and
                                               ch.choices[0].logprobs else [])]
    assert streamed == lp.token_logprobs
    chat = c.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=0, logprobs=True,
                                     top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    assert b"".join(bytes(t.bytes) for t in content).decode() == chat.choices[0].message.content == ref["chat"]
    chunks = list(c.chat.completions.create(model=NAME, messages=MSGS, max_tokens=20, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True))
    assert [t.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
            for t in ch.choices[0].logprobs.content] == [t.logprob for t in content]
    for bad, param in ((dict(top_logprobs=2), "top_logprobs"), (dict(logprobs=True, top_logprobs=21), "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2, **bad)
        assert e.value.body["param"] == param


def test_structured_outputs_are_plain_constrained_decoding_alone_and_under_load(live, smollm2_path):
    """response_format json_schema (strict) and json_object: the answer parses, matches the schema, and is the
    in-process greedy constrained decoding of the same request, alone, streamed, and with 4 clients at once."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
              "required": ["name", "age", "skills"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Describe a programmer named Ada as JSON."}]
    eng = swiftk.load(str(smollm2_path), persist=False)
    want = eng.generate(ask, chat=True, max_new_tokens=80, method="autoregressive",
                        grammar=swiftk.Grammar.json_schema(schema)).text
    obj = json.loads(want)
    assert set(obj) == {"name", "age", "skills"} and isinstance(obj["age"], int)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    c = live.client()
    r = c.chat.completions.create(model=NAME, messages=ask, max_tokens=80, temperature=0, response_format=rf)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model=NAME, messages=ask, max_tokens=80, temperature=0,
                                            response_format=rf, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    out, errors = {}, []

    def client(i):
        try:
            kw = dict(response_format=rf) if i % 2 == 0 else dict(response_format={"type": "json_object"})
            out[i] = live.client().chat.completions.create(model=NAME, messages=ask, max_tokens=80, temperature=0,
                                                           **kw).choices[0].message.content
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join(300) for t in threads]
    assert not errors, errors
    assert out[0] == out[2] == want
    obj_mode = eng.generate(ask, chat=True, max_new_tokens=80, method="autoregressive",
                            grammar=swiftk.Grammar.json_object()).text
    assert out[1] == out[3] == obj_mode and isinstance(json.loads(obj_mode), dict)
    for bad in ({"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}},
                {"type": "json_schema", "json_schema": {"schema": "not a schema"}}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=NAME, messages=ask, max_tokens=4, response_format=bad)
        assert e.value.body["param"] == "response_format", bad


def test_an_unknown_model_is_404_model_not_found(live):
    with pytest.raises(openai.NotFoundError) as e:
        live.client().completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_a_chat_over_the_context_without_max_tokens_says_context_length_exceeded(live, ref):
    """max_tokens omitted: the default is the rest of the context, and a prompt that fills it is the context
    error clients trim their history on (it was "max_tokens must be >= 1, got -3908", code null)."""
    long = [{"role": "user", "content": " ".join(["word"] * (ref["max_context"] + 10))}]
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(model=NAME, messages=long)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
    assert "max_tokens" not in e.value.body["message"]


def test_streamed_usage_comes_once_in_the_last_chunk_and_only_when_asked(live):
    c = live.client()
    asked = list(c.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                      stream_options={"include_usage": True}))
    assert [i for i, ch in enumerate(asked) if ch.usage is not None] == [len(asked) - 1]
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 8
    plain = list(c.chat.completions.create(model=NAME, messages=MSGS, max_tokens=8, temperature=0, stream=True))
    assert all(ch.usage is None for ch in plain)


def test_usage_counts_the_cached_prompt_tokens(live):
    c = live.client()
    prompt = PROMPT + " # a prompt of its own, for the cache"
    c.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == r.model_extra["swiftk"]["prompt_reused"] > 0


def test_cors_is_off_by_default_and_allowed_origins_opens_it(live, smollm2_path):
    pre = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}

    def options(url):
        req = urllib.request.Request(url + "/v1/chat/completions", headers=pre, method="OPTIONS")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.headers
        except urllib.error.HTTPError as e:
            return e.code, e.headers

    status, headers = options(live.url)
    assert "access-control-allow-origin" not in {k.lower() for k in headers}
    srv = Live(smollm2_path, "--allowed-origins", "http://localhost:3000")
    try:
        status, headers = options(srv.url)
        assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "authorization" in headers["access-control-allow-headers"].lower()
        status, js, headers = srv.post("/v1/completions", json.dumps(
            {"model": NAME, "prompt": PROMPT, "max_tokens": 2}).encode(), {"Origin": "http://localhost:3000"})
        assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:3000"
    finally:
        srv.stop()
    out = subprocess.run([sys.executable, "-m", "swiftk.cli", "serve", "--model", str(smollm2_path),
                          "--allowed-origins", "localhost:3000/app"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "allowed origin" in out.stderr


@pytest.mark.parametrize("messages", [
    [{"role": "robot", "content": "hi"}],
    [{"role": "user"}],
    [{"role": "user", "content": 3}],
    [],
])
def test_malformed_messages_get_400(live, messages):
    with pytest.raises(openai.BadRequestError):
        live.client().chat.completions.create(model=NAME, messages=messages, max_tokens=4)


def test_prompt_past_the_context_and_raw_garbage_get_400(live, ref):
    long = " ".join(["word"] * (ref["max_context"] + 10))
    with pytest.raises(openai.BadRequestError) as e:
        live.client().completions.create(model=NAME, prompt=long, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    for body in (b"{not json", b"[1, 2]", b'{"model": "smollm2", "prompt": [99999999], "max_tokens": 2}',
                 b'{"model": "smollm2", "prompt": "x", "max_tokens": true}',
                 b'{"model": "smollm2", "prompt": "x", "temperature": NaN}'):
        status, js, _ = live.post("/v1/completions", body)
        assert status == 400 and js["error"]["message"], (body, js)
    status, js, _ = live.post("/v1/completions", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nested too deeply" in js["error"]["message"]
    with socket.create_connection(("127.0.0.1", live.port)) as s:   # a client gone half-way through its body
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"mo")
    try:   # refused from its Content-Length, before it is read: the client may see the closed connection
        status, js, _ = live.post("/v1/completions", b"x" * (9 << 20))   # first (a reset, or a broken pipe
        assert status == 413 and "error" in js                          # while it is still sending)
    except urllib.error.URLError as e:
        assert isinstance(e.reason, (ConnectionResetError, BrokenPipeError)), e
    # still serving, and serving correctly
    r = live.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref["text"]


def test_abandoned_stream_is_cancelled_and_the_next_request_served(live, ref):
    before = live.health()["cancelled"]
    stream = live.client().completions.create(model=NAME, prompt="Once upon a time", max_tokens=400,
                                              temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 120   # a hang guard: the decode must end long before its 400 tokens
    while live.health()["cancelled"] == before:
        assert time.monotonic() < deadline, "abandoned stream never cancelled"
        time.sleep(0.2)
    r = live.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref["text"]


def test_abandoned_plain_request_is_cancelled(live, ref):
    before = live.health()["cancelled"]
    # long enough not to finish before the hang-up is noticed (~1.2 s): 400 tokens once did, after this file's
    # earlier requests (their outputs are drafts for this one)
    n = min(1500, ref["max_context"] - 16)
    body = json.dumps({"model": NAME, "prompt": "Once upon a time", "max_tokens": n, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", live.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(1.0)   # let it start decoding, then hang up without reading
    deadline = time.monotonic() + 120   # a hang guard
    while live.health()["cancelled"] == before:
        assert time.monotonic() < deadline, "abandoned request never cancelled"
        time.sleep(0.2)
    r = live.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref["text"]


@pytest.fixture(scope="module")
def guarded(smollm2_path):
    srv = Live(smollm2_path, "--api-key", "k1", "--api-key", "k2", "--history-scope", "key", "--queue-size", "0",
               "--max-batch", "1")
    yield srv
    _, err = srv.stop()
    assert "Traceback" not in err, err[-3000:]


def test_api_keys_are_required(guarded):
    for key in ("unused", "k3", "k1k1"):
        with pytest.raises(openai.AuthenticationError):
            guarded.client(key).completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
    body = json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 2}).encode()
    for headers in ({}, {"Authorization": "k1"}, {"Authorization": "Basic k1"}):
        status, js, _ = guarded.post("/v1/completions", body, headers)
        assert status == 401 and js["error"]["code"] == "invalid_api_key"
    assert guarded.client("k1").models.list().data[0].id == NAME
    assert guarded.health()["status"] == "ok"   # the health probe needs no key


def test_history_scope_key_keeps_clients_apart(guarded):
    """The same prompt twice under k1 drafts from k1's first output; under k2 the history is empty."""
    def hist(key):
        r = guarded.client(key).completions.create(model=NAME, prompt="The history of Rome", max_tokens=48,
                                                   temperature=0)
        return r.choices[0].text, r.model_extra["swiftk"]["accepted_by_source"].get("history", 0)

    first, h1 = hist("k1")
    again, h2 = hist("k1")
    other, h3 = hist("k2")
    assert first == again == other   # lossless whatever drafts
    assert h1 == 0 and h3 == 0 and h2 > 0
    # nor does one key's request reuse the KV another's (or its own) left: its prefill time would tell
    r = guarded.client("k1").completions.create(model=NAME, prompt="The history of Rome", max_tokens=4, temperature=0)
    assert r.model_extra["swiftk"]["prompt_reused"] == 0


def test_a_conversations_next_turn_reuses_its_start(live, ref):
    """In the server's scope a request prefills only where its prompt leaves the previous request's prompt and
    answer, with the output of a whole prefill."""
    c = live.client()
    c.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    r = c.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref["text"]
    assert r.model_extra["swiftk"]["prompt_reused"] == r.usage.prompt_tokens - 1


def test_full_queue_gets_429_with_retry_after(guarded):
    stream = guarded.client("k1").completions.create(model=NAME, prompt="Once upon a time", max_tokens=300,
                                                      temperature=0, stream=True)
    next(iter(stream))   # the engine's one slot is busy with it now; queue size 0
    status, js, headers = guarded.post("/v1/completions", json.dumps(
        {"model": NAME, "prompt": PROMPT, "max_tokens": 2}).encode(), {"Authorization": "Bearer k2"})
    stream.close()
    assert status == 429 and js["error"]["type"] == "rate_limit_error"
    assert int(headers["Retry-After"]) >= 1


def test_a_request_being_opened_counts_against_the_limits(smollm2_path):
    """max_batch 2 + queue 1 admit 3 requests, also while the decode thread is opening one (taken off the queue, not
    yet running): it was counted nowhere then, and a 4th request got in."""
    from swiftk.serve.api import APIError
    from swiftk.serve.decode import DecodeThread
    eng = swiftk.load(str(smollm2_path), persist=False, datastore=False)
    opening, release = threading.Event(), threading.Event()
    real = eng.calls.open_call

    def slow_open(*a, **kw):
        opening.set()
        release.wait(60)
        return real(*a, **kw)

    eng.calls.open_call = slow_open
    q = DecodeThread(eng, max_batch=2, queue_size=1)
    try:
        req = lambda: eng.calls.request(PROMPT, max_new_tokens=2)   # noqa: E731
        futs = [q.submit(req())]
        assert opening.wait(60)
        assert (q.waiting, q.running) == (0, 1)   # as /health shows it
        futs += [q.submit(req()) for _ in range(2)]
        with pytest.raises(APIError) as e:
            q.submit(req())
        assert e.value.status == 429
        release.set()
        assert all(len(f.result(120).token_ids) == 2 for f in futs)
    finally:
        release.set()
        q.close()


def test_bad_server_options_fail_at_startup(smollm2_path, tmp_path):
    env = {**os.environ, "SWIFTK_PERSIST": "0"}
    for args, message in ((["--swift", "max_draft=0"], "max_draft"), (["--host", "999.1.1.1"], "cannot listen on")):
        out = subprocess.run([sys.executable, "-m", "swiftk.cli", "serve", "--model", str(smollm2_path), *args],
                             capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_sigterm_cancels_in_flight_and_exits(smollm2_path):
    srv = Live(smollm2_path)
    got = []

    def read():
        try:
            for ch in srv.client().completions.create(model=NAME, prompt="Once upon a time", max_tokens=2000,
                                                      temperature=0, stream=True):
                got.append(ch)
        except Exception as e:  # noqa: BLE001 - the stream ends with the server's error event
            got.append(e)

    th = threading.Thread(target=read)
    th.start()
    while not got:
        time.sleep(0.05)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(60)   # the issue asks for <= 10 s; the bound here only guards against a hang on a slow CI
    took = time.monotonic() - t0
    th.join(30)
    assert not th.is_alive()
    _, err = srv.proc.communicate()
    assert "Traceback" not in err, err[-3000:]
    assert len(got) < 2000
    print(f"SIGTERM to exit: {took:.2f} s")


def test_key_scope_refuses_prefix_reuse(smollm2_path):
    """Asking for prefix reuse under history_scope='key' is refused at startup, not ignored."""
    from swiftk.errors import SwiftkError
    from swiftk.serve.app import Server

    eng = swiftk.load(str(smollm2_path), persist=False)
    with pytest.raises(SwiftkError, match="history_scope='key'"):
        Server(eng, NAME, api_keys=["k"], history_scope="key", options={"prefix_cache": True})
    assert Server(eng, NAME, api_keys=["k"], history_scope="key").options["prefix_cache"] is False
