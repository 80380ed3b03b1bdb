"""Structured output and tool calls, through the `openai` client over a real socket on the real default model
(SmolLM2-135M-Instruct, greedy): every JSON output validates against its schema (the `jsonschema` package), regexes
and choices hold, tool_choice=required gives a call whose arguments validate against its tool's parameters,
streaming gives what the plain response gives, bad schemas and regexes are refused by field before anything runs,
and a constrained request batched with an unconstrained one leaves the latter's tokens as they are alone. On the
tiny model: speculative drafts verified against a grammar give the tokens of decoding without speculation, and the
tool-call syntax of each template family parses back.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import replace

import jsonschema
import openai
import pytest
from conftest import running_server, tiny_engine
from test_server import make_settings

from inferlab.engine.grammar import Constraint, GrammarCompiler, TokenGrammar
from inferlab.engine.spec.proposers import NgramDrafter
from inferlab.engine.spec.session import Speculation
from inferlab.errors import InvalidRequestError
from inferlab.server import create_app
from inferlab.server.schemas import ChatCompletionRequest
from inferlab.server.tools import HERMES, LLAMA3, family, tool_use

SCHEMAS = {
    "nested object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array of enums": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
            "score": {"type": "number"},
        },
        "required": ["age", "height_m", "score"],
        "additionalProperties": False,
    },
    "array of objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "visited": {"type": "boolean"}},
            "required": ["city", "visited"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 16}},
            "required": ["zone"],
        },
    },
}


@pytest.fixture(scope="module")
def engine():
    from inferlab.api import load_engine

    engine = load_engine(device="cpu", precision="fp32")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(engine):
    with running_server(create_app(engine, make_settings(max_new_tokens_cap=160), "smollm2")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def chat(client, stream: bool = False, **body):
    """The response's (text, finish_reason, tool calls as (name, arguments) pairs), streamed or not."""
    if not stream:
        choice = client.chat.completions.create(model="smollm2", temperature=0, **body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, choice.finish_reason, calls
    text, reason, calls = None, None, []
    for chunk in client.chat.completions.create(model="smollm2", temperature=0, stream=True, **body):
        for choice in chunk.choices:
            if choice.delta.content:
                text = (text or "") + choice.delta.content
            for call in choice.delta.tool_calls or []:
                calls.append((call.function.name, call.function.arguments))
            reason = choice.finish_reason or reason
    return text, reason, calls


# ---- JSON schemas, regexes, choices -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_output_validates_streamed_or_not(client, name):
    schema = SCHEMAS[name]
    body = {
        "messages": ask(f"Answer in JSON: {name.replace('_', ' ')} about a person who lives in Paris."),
        "max_tokens": 160,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    }
    text, reason, _ = chat(client, **body)
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), schema)
    assert chat(client, stream=True, **body) == (text, reason, [])


@pytest.mark.slow
def test_json_object_and_vllm_fields_on_both_routes(client):
    text, reason, _ = chat(
        client,
        messages=ask("Describe a cat as a JSON object with its name and age."),
        max_tokens=160,
        response_format={"type": "json_object"},
    )
    assert reason == "stop" and isinstance(json.loads(text), dict)
    phone = re.compile(r"[0-9]{3}-[0-9]{4}")
    completion = client.completions.create(
        model="smollm2",
        prompt="My phone number is ",
        max_tokens=16,
        temperature=0,
        extra_body={"guided_regex": phone.pattern},
    )
    assert phone.fullmatch(completion.choices[0].text) and completion.choices[0].finish_reason == "stop"
    for extra in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        text, reason, _ = chat(client, messages=ask("Is Paris in France?"), max_tokens=8, extra_body=extra)
        assert text in ("yes", "no") and reason == "stop"
    schema = SCHEMAS["numbers"]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="smollm2",
            prompt="A person: ",
            max_tokens=80,
            temperature=0,
            stream=True,
            extra_body={"guided_json": schema},
        )
    )
    jsonschema.validate(json.loads(streamed), schema)
    grammar = 'start: "The answer is " ("yes" | "no") "."'
    text, reason, _ = chat(
        client, messages=ask("Is the sky blue?"), max_tokens=16, extra_body={"guided_grammar": grammar}
    )
    assert re.fullmatch(r"The answer is (yes|no)\.", text) and reason == "stop"


@pytest.mark.slow
def test_a_grammar_longer_than_max_tokens_ends_with_length(client):
    completion = client.completions.create(
        model="smollm2", prompt="Letters: ", max_tokens=6, temperature=0, extra_body={"guided_regex": "(abc ){40}"}
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and completion.usage.completion_tokens == 6
    assert ("abc " * 40).startswith(choice.text) and choice.text


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
                }
            },
            "response_format",
            "frobnicate",
        ),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": {"type": "integer", "minimum": "zero"}}, "guided_json", "minimum"),
        ({"guided_regex": "a(b"}, "guided_regex", "regex"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one structured output"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "minProperties",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(tiny_client, extra, param, words):
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        tiny_client.chat.completions.create(model="tiny", messages=ask("Hi"), max_tokens=4, extra_body=extra)
    error = caught.value.body
    assert error["param"] == param and words in error["message"] and param in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def tiny_client(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, "paged", max_new_tokens=8)
    with running_server(create_app(engine, make_settings(), "tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    engine.close()


# ---- tool calls ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_tool_call_has_valid_arguments_streamed_or_not(client, choice):
    body = {
        "messages": ask("What is the weather like in Paris today?"),
        "max_tokens": 120,
        "tools": [WEATHER, TIME],
        "tool_choice": choice,
        "parallel_tool_calls": False,
    }
    text, reason, calls = chat(client, **body)
    assert reason == "tool_calls" and text is None and len(calls) == 1, (text, reason, calls)
    name, arguments = calls[0]
    tool = {t["function"]["name"]: t["function"] for t in (WEATHER, TIME)}[name]
    jsonschema.validate(json.loads(arguments), tool["parameters"])
    assert isinstance(choice, str) or name == "get_weather"
    assert chat(client, stream=True, **body) == (text, reason, calls)


@pytest.mark.slow
def test_tool_messages_go_back_through_the_template(client):
    messages = [
        *ask("What is the weather in Paris?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    text, reason, calls = chat(client, messages=messages, max_tokens=24, tools=[WEATHER], tool_choice="none")
    assert text and reason in ("stop", "length") and calls == []


def test_each_familys_tool_call_syntax_parses_back():
    qwen = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>"
    llama = "{% if tools %}Environment: ipython{% endif %}<|python_tag|>"
    assert family(qwen) == HERMES and family(llama) == LLAMA3 and family(None) == HERMES
    body = ChatCompletionRequest(messages=ask("Hi"), tools=[WEATHER, TIME])
    hermes = tool_use(body, qwen)
    content, calls = hermes.parse(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    assert content == "Let me look." and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert hermes.parse("<tool_call>\n{not json}\n</tool_call>") == ("<tool_call>\n{not json}\n</tool_call>", [])
    content, calls = tool_use(body, llama).parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}')
    assert (
        content is None
        and calls[0].function.name == "get_time"
        and json.loads(calls[0].function.arguments) == {"zone": "UTC"}
    )
    assert tool_use(body, llama).parse("It is sunny.") == ("It is sunny.", [])


# ---- batching and speculation --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_constrained_and_a_free_request_batched_each_get_what_they_asked(engine, client):
    free = {"messages": ask("Tell me about Paris."), "max_tokens": 40}
    schema = SCHEMAS["numbers"]
    constrained = {
        **free,
        "max_tokens": 80,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    }
    alone = client.chat.completions.create(model="smollm2", temperature=0, logprobs=True, **free)
    results: dict[str, object] = {}

    def send(key: str, body: dict) -> None:
        results[key] = client.chat.completions.create(model="smollm2", temperature=0, logprobs=True, **body)

    threads = [threading.Thread(target=send, args=(k, b)) for k, b in (("free", free), ("constrained", constrained))]
    with engine._lock:  # the loop cannot step until both wait: their prompts and decodes share its steps
        for thread in threads:
            thread.start()
        deadline = time.perf_counter() + 30
        while len(engine.scheduler.waiting) < 2 and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert len(engine.scheduler.waiting) == 2
    for thread in threads:
        thread.join(60)
    tokens = [t.token for t in results["free"].choices[0].logprobs.content]
    assert tokens == [t.token for t in alone.choices[0].logprobs.content]
    assert results["free"].choices[0].message.content == alone.choices[0].message.content
    jsonschema.validate(json.loads(results["constrained"].choices[0].message.content), schema)


@pytest.mark.parametrize(
    "constraint",
    [Constraint("regex", "(ab|abc)+x", "guided_regex"), Constraint("choice", ["abab", "abcabc"], "guided_choice")],
)
def test_speculative_drafts_are_verified_against_the_grammar(tiny_tokenizer, constraint):
    """spec=ngram in the engine loop, greedy: the tokens of the same constrained requests without speculation, and
    drafts were proposed (a repetitive prompt gives the n-gram lookup something to copy)."""
    engine = tiny_engine(tiny_tokenizer, "paged")
    prompt = engine.encode_prompt("ab abc ab abc ab abc ab abc abcab")
    params = engine.sampling_params(max_new_tokens=12, constraint=constraint)
    plain = [e.token_id for e in engine.iter_events(prompt, params) if e.token_id is not None]
    engine.speculation = Speculation(NgramDrafter(max_n=2), k=3, adaptive=False)
    speculative = [e.token_id for e in engine.iter_events(prompt, params) if e.token_id is not None]
    assert speculative == plain
    assert engine.stats()["spec_proposed"] > 0
    text = engine.tokenizer.decode(plain)
    if constraint.kind == "choice":
        assert text in constraint.spec
    else:  # the whole match, or a prefix of one cut by max_new_tokens
        assert re.fullmatch(r"(ab|abc)+x", text) or (len(plain) == 12 and re.fullmatch(r"(ab|abc)*(a|ab|abc)?", text))
    engine.close()


def test_speculation_alone_refuses_a_constraint_by_name(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, "none")
    engine.speculation = Speculation(NgramDrafter(max_n=2), k=3, adaptive=False)
    params = replace(engine.sampling_params(max_new_tokens=4), constraint=Constraint("regex", "a+", "guided_regex"))
    with pytest.raises(InvalidRequestError, match="guided_regex: constrained output with speculative decoding"):
        list(engine.iter_events(engine.encode_prompt("hi"), params))


@pytest.mark.slow
def test_real_model_spec_self_keeps_a_schemas_greedy_tokens():
    """SmolLM2 with spec=self (its int4 draft) in the engine loop: JSON-schema requests give the tokens of spec off,
    and drafts were accepted through the grammar."""
    from inferlab.api import load_engine

    engine = load_engine(device="cpu", precision="fp32", spec="self", **{"spec.adaptive": False})
    speculation = engine.speculation
    schema = SCHEMAS["nested object"]
    ids = engine.encode_prompt("", messages=ask("Answer in JSON: a person who lives in Paris."))
    params = engine.sampling_params(max_new_tokens=64, constraint=Constraint("json", schema, "response_format"))
    engine.speculation = None
    plain = engine._collect(engine.iter_events(ids, params))
    engine.speculation = speculation
    got = engine._collect(engine.iter_events(ids, params))
    engine.close()
    assert got.token_ids == plain.token_ids and got.finish_reason == plain.finish_reason == "stop"
    jsonschema.validate(json.loads(got.text), schema)
    assert engine.stats()["spec_accepted"] > 0


def test_one_token_checks_agree_with_the_mask(tiny_tokenizer):
    """TokenGrammar.allows (one token checked, the engine loop's way for a greedy request's argmax) says of every
    token what the whole vocabulary's mask says, at every position of a JSON document and a regex match."""
    compiler = GrammarCompiler(tiny_tokenizer, 300)
    cases = [
        (Constraint("json", SCHEMAS["numbers"], "guided_json"), '{"age": 41, "height_m": 1.8, "score": -3}'),
        (Constraint("regex", "[a-c]+z", "guided_regex"), "abcabz"),
    ]
    for constraint, text in cases:
        grammar = compiler.start(constraint)
        for token in tiny_tokenizer.encode(text) + [None]:
            forbidden = grammar.forbidden()
            assert [grammar.allows(t) for t in range(300)] == [not f for f in forbidden.tolist()]
            if token is not None:
                grammar.advance(token)
        assert grammar.complete


@pytest.mark.parametrize(
    "constraint",
    [Constraint("regex", "[^#]{4,40}", "guided_regex"), Constraint("json", SCHEMAS["numbers"], "guided_json")],
)
def test_the_loops_argmax_check_gives_the_masked_tokens(tiny_tokenizer, constraint, monkeypatch):
    """Greedy constrained requests in the engine loop (which takes a step's argmax where its bit in the grammar's mask
    is set, and masks the whole row only where it is not) give the tokens of the single-sequence path, which masks every row; both
    ways were taken."""
    prompt, calls = "the cat sat on", {"unpacked": 0, "checks": 0}
    allows, forbidden = TokenGrammar.allows, TokenGrammar.forbidden

    def counted(name, method):
        def wrapper(self, *args):
            calls[name] += 1
            return method(self, *args)

        return wrapper

    single = tiny_engine(tiny_tokenizer, "contiguous", max_new_tokens=40)
    params = single.sampling_params(max_new_tokens=40, constraint=constraint)
    want = [e.token_id for e in single.iter_events(single.encode_prompt(prompt), params) if e.token_id is not None]
    single.close()
    monkeypatch.setattr(TokenGrammar, "allows", counted("checks", allows))
    monkeypatch.setattr(TokenGrammar, "forbidden", counted("unpacked", forbidden))
    loop = tiny_engine(tiny_tokenizer, "paged", max_new_tokens=40)
    assert loop.route("generate") != single.route("generate")
    got = [e.token_id for e in loop.iter_events(loop.encode_prompt(prompt), params) if e.token_id is not None]
    loop.close()
    assert got == want and len(got) > 3
    assert calls["checks"] in (len(got), len(got) + 1)  # one per token (and the closing EOS)
    # the random model's argmax is mostly outside a JSON document's next tokens, and often inside the regex's
    assert 0 < calls["unpacked"] < calls["checks"] if constraint.kind == "regex" else calls["unpacked"] > 0


def test_tools_and_tool_messages_reach_the_chat_template(tiny_tokenizer):
    """A template that reads `tools` (and tool messages' ids) gets them from the chat route: the request's prompt is
    the one the template renders with them."""
    template = (
        "{% for t in tools or [] %}<tool>{{ t.function.name }}:{{ t.function.parameters | tojson }}</tool>{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
        "<call>{{ c.function.arguments | tojson }}</call>{% endfor %}{{ m.tool_call_id or '' }}\n{% endfor %}<assistant>"
    )
    tokenizer = replace(tiny_tokenizer, chat_template=template)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    engine = tiny_engine(tokenizer, "paged", max_new_tokens=4)
    messages = [
        *ask("Weather in Paris?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    rendered = tokenizer.render_chat(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        ],
        tools=[tool],
    )
    assert "<tool>get_weather:" in rendered and '<call>{"city": "Paris"}</call>' in rendered and "sunnyc1" in rendered
    with running_server(create_app(engine, make_settings(max_prompt_chars=100000), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        usage = client.chat.completions.create(model="tiny", messages=messages, tools=[tool], max_tokens=2).usage
    assert usage.prompt_tokens == len(tokenizer.encode(rendered))
    engine.close()
