"""Tool calls through `swiftk serve`: tools shown by a chat template in the Hermes <tool_call> format (here one given
with --chat-template, as SmolLM2's own defines none), tool_choice required / named (a grammar: the call is plain
constrained decoding) / auto (free decoding, parsed) / none, streamed and not, tool results in the history, through
OpenAI's client and langchain-openai; and the parser and the stream holdback on their own."""
import json
import random
import threading

import pytest

from swiftk.serve.tools import Holdback, parse_tools, split_calls

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import swiftk  # noqa: E402
from test_serve import NAME, Live  # noqa: E402 - the same server harness

# A ChatML template that shows tools and asks for Hermes-format calls (written for these tests)
HERMES = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call functions. Their signatures, one per line:
{% for t in tools %}{{ t | tojson }}
{% endfor %}To call one, answer <tool_call>
{"name": "NAME", "arguments": {...}}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'system' and loop.first %}{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tooled(smollm2_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("tmpl") / "hermes.jinja"
    path.write_text(HERMES)
    srv = Live(smollm2_path, "--chat-template", str(path))
    yield srv
    _, err = srv.stop()
    assert "Traceback" not in err, err[-3000:]


@pytest.fixture(scope="module")
def eng(smollm2_path):
    e = swiftk.load(str(smollm2_path), persist=False)
    e.tokenizer.chat_template = HERMES
    return e


def _plain(eng, messages, choice, max_new=60) -> str:
    """The in-process greedy decoding the server's answer must equal: the same template, tools and grammar."""
    tools = parse_tools(TOOLS, choice, None, HERMES)
    ids = eng.encode_prompt(messages, chat=True, tools=tools.for_template())
    return eng.generate(ids, max_new_tokens=max_new, method="autoregressive", grammar=tools.grammar()).text


def _valid_weather(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("c", "f")
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_calls_are_plain_constrained_decoding(tooled, eng, choice):
    want = _plain(eng, ASK, choice)
    content, calls = split_calls(want, {"get_weather", "get_time"})
    assert calls and content is None
    c = tooled.client()
    r = c.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
                                  max_tokens=60)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [(x.function.name, json.loads(x.function.arguments)) for x in ch.message.tool_calls] == \
        [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls]
    if isinstance(choice, dict):
        assert all(x.function.name == "get_weather" for x in ch.message.tool_calls)
        _valid_weather(ch.message.tool_calls[0])
    assert r.swiftk["accepted_by_source"].get("grammar", 0) > 0   # the tags and keys were drafted for free
    # streamed: the calls come whole in one delta, then the finish on its own
    chunks = list(c.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            temperature=0, max_tokens=60, stream=True))
    deltas = [x for ch in chunks if ch.choices for x in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(k, x.function.name, x.function.arguments) for k, x in enumerate(ch.message.tool_calls)]
    assert [x.choices[0].finish_reason for x in chunks if x.choices][-1] == "tool_calls"
    assert not any(x.choices[0].delta.content for x in chunks if x.choices)


def test_tool_calls_under_four_clients_equal_the_lone_decoding(tooled, eng):
    want = _plain(eng, ASK, "required")
    out, errors = {}, []

    def client(i):
        try:
            r = tooled.client().chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                                        temperature=0, max_tokens=60)
            out[i] = [(x.function.name, json.loads(x.function.arguments)) for x in r.choices[0].message.tool_calls]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join(300) for t in threads]
    assert not errors, errors
    expect = [(x["function"]["name"], json.loads(x["function"]["arguments"]))
              for x in split_calls(want, {"get_weather", "get_time"})[1]]
    assert all(out[i] == expect for i in range(4))


def test_a_tool_result_in_the_history_is_rendered_and_answered(tooled, eng):
    hist = ASK + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    ids = eng.encode_prompt(hist, chat=True, tools=TOOLS)
    text = eng.tokenizer.decode(ids)
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text and '"arguments": {"city": "Paris"' in text
    want = eng.generate(ids, max_new_tokens=24, method="autoregressive").text
    r = tooled.client().chat.completions.create(model=NAME, messages=hist, tools=TOOLS, temperature=0, max_tokens=24)
    content, calls = split_calls(want, {"get_weather", "get_time"})
    assert r.choices[0].message.content == content
    assert (r.choices[0].message.tool_calls is None) == (calls is None)


def test_auto_and_none_decode_freely(tooled, eng):
    """auto: the plain decoding with the tools shown, its calls parsed out; none: the tools are not shown."""
    c = tooled.client()
    for choice, shown in (("auto", TOOLS), ("none", None)):
        ids = eng.encode_prompt(ASK, chat=True, tools=shown)
        want = eng.generate(ids, max_new_tokens=30, method="autoregressive").text
        r = c.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
                                      max_tokens=30)
        content, calls = split_calls(want, {"get_weather", "get_time"}) if choice == "auto" else (want, None)
        assert r.choices[0].message.content == content and (r.choices[0].message.tool_calls is None) == (calls is None)
        streamed = list(c.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                  temperature=0, max_tokens=30, stream=True))
        assert "".join(x.choices[0].delta.content or "" for x in streamed if x.choices) == (content or "")


def test_langchain_binds_tools_and_gets_the_call(tooled):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=tooled.url + "/v1", api_key="unused", model=NAME, temperature=0, max_tokens=60,
                        max_retries=0)
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")
    msg = bound.invoke("What is the weather in Paris?")
    assert len(msg.tool_calls) >= 1 and msg.tool_calls[0]["name"] == "get_weather"
    assert set(msg.tool_calls[0]["args"]) == {"city", "unit"}
    streamed = None
    for part in bound.stream("What is the weather in Paris?"):
        streamed = part if streamed is None else streamed + part
    assert [(t["name"], t["args"]) for t in streamed.tool_calls] == [(t["name"], t["args"]) for t in msg.tool_calls]


@pytest.mark.parametrize("kw, param", [
    (dict(tool_choice="required"), "tool_choice"),                                     # no tools
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools"),
    (dict(tools=[WEATHER, WEATHER]), "tools"),
    (dict(tools=[{"type": "retrieval"}]), "tools"),
    (dict(tools=TOOLS, response_format={"type": "json_object"}), "response_format"),
])
def test_bad_tool_requests_get_400_naming_the_field(tooled, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        tooled.client().chat.completions.create(model=NAME, messages=ASK, max_tokens=4, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_a_bad_parameters_schema_and_bad_history_get_400(tooled):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError):
        tooled.client().chat.completions.create(model=NAME, messages=ASK, max_tokens=4, tools=[bad],
                                                tool_choice="required")
    for hist in ([{"role": "tool", "content": "x"}],                                   # no tool_call_id
                 [{"role": "user", "content": None}],
                 [{"role": "user", "content": "x", "tool_call_id": "c"}]):
        with pytest.raises(openai.BadRequestError):
            tooled.client().chat.completions.create(model=NAME, messages=hist, max_tokens=4)


def test_a_template_without_tools_refuses_them_but_takes_tool_choice_none(smollm2_path):
    from test_serve import Live as L   # a server on the model's own template (SmolLM2's shows no tools)
    srv = L(smollm2_path)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            srv.client().chat.completions.create(model=NAME, messages=ASK, max_tokens=4, tools=TOOLS)
        assert "chat template" in e.value.body["message"] and e.value.body["param"] == "tools"
        r = srv.client().chat.completions.create(model=NAME, messages=ASK, max_tokens=4, tools=TOOLS,
                                                 tool_choice="none")
        assert r.choices[0].message.tool_calls is None
    finally:
        srv.stop()


# ------------------------------------------------------------------ the parser and the holdback alone
NAMES = {"get_weather", "get_time"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'


@pytest.mark.parametrize("text, content, n", [
    (CALL, None, 1),
    ("Let me look.\n" + CALL, "Let me look.", 1),
    (CALL + "\n" + CALL.replace("get_weather", "get_time"), None, 2),
    ("no call here", "no call here", 0),
    (CALL + " and then more text", CALL + " and then more text", 0),                  # text after a call
    (CALL.replace("get_weather", "launch"), CALL.replace("get_weather", "launch"), 0),   # not a given tool
    ('<tool_call>\n{"name": "get_weather", "arguments": {oops}\n</tool_call>', None, -1),  # not JSON
    ('<tool_call>\n{"name": "get_weather", "arguments": "x"}\n</tool_call>', None, -1),   # arguments not an object
    ('<tool_call>\n{"name": "get_weather", "argu', None, -1),                           # cut by max_tokens
])
def test_split_calls_takes_only_whole_calls_of_given_tools(text, content, n):
    got_content, calls = split_calls(text, NAMES)
    if n <= 0:
        assert calls is None and got_content == (text if content is None else content)
    else:
        assert got_content == content and len(calls) == n
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"} or n == 2


@pytest.mark.parametrize("text", ["Sure.\n  " + CALL, "plain answer with < and <tool but no call  ",
                                  "x <tool_call> broken", CALL, "a\n\n" + CALL + "\n" + CALL])
def test_the_streamed_holdback_adds_up_to_the_whole_response(text):
    rng = random.Random(7)
    for _ in range(20):
        h, out, i = Holdback(), "", 0
        while i < len(text):
            k = rng.randint(1, 6)
            out += h.feed(text[i:i + k])
            i += k
        rest, calls = h.finish(NAMES)
        content, want = split_calls(text, NAMES)
        assert out + rest == (content or "") and (calls is not None) == (want is not None)
        assert "<tool_call>" not in out or calls is None


def test_split_calls_survives_any_model_text():
    assert split_calls('<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>', NAMES)[1] is None
    deep = "<tool_call>" + "[" * 100000 + "</tool_call>"
    assert split_calls(deep, NAMES) == (deep, None)


def test_nested_parameter_schemas_keep_their_definitions(eng):
    """A tool's $defs (what openai.pydantic_function_tool makes of nested models) move to the grammar's root with
    their references; a call under it parses and fills the nested object."""
    addr = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
            "additionalProperties": False}
    nested = {"type": "function", "function": {"name": "ship", "description": None, "parameters": {
        "$defs": {"Addr": addr}, "type": "object", "properties": {"to": {"$ref": "#/$defs/Addr"}},
        "required": ["to"], "additionalProperties": False}}}
    tools = parse_tools([nested, TIME], {"type": "function", "function": {"name": "ship"}}, None, HERMES)
    ids = eng.encode_prompt([{"role": "user", "content": "Ship it to Oslo."}], chat=True, tools=tools.for_template())
    text = eng.generate(ids, max_new_tokens=60, method="autoregressive", grammar=tools.grammar()).text
    _, calls = split_calls(text, tools.names)
    assert calls and set(json.loads(calls[0]["function"]["arguments"])["to"]) == {"city"}
    from swiftk.serve.api import APIError
    with pytest.raises(APIError, match="must describe an object"):
        parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "auto",
                    None, HERMES)
