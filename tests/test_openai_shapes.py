"""The request shapes real clients send, through the `openai` client over a real socket (uvicorn on a free
loopback port, in this process so the references can use the same engine).

References: the engine's own generate/chat for the plain shapes; for echo + logprobs the log-softmax of
the model's full forward of the prompt; for the penalties a greedy decode written here from OpenAI's
definitions over the model's full-forward logits.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from conftest import running_server, tiny_engine
from test_server import PROMPT, make_settings

from inferlab.server import create_app

KEY = "k-shapes"


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, slots=4, max_new_tokens=16)
    engine.scheduler.config.max_batched_tokens = 8  # long prompts arrive in several chunks
    return engine


@pytest.fixture(scope="module")
def client(engine):
    with running_server(create_app(engine, make_settings(api_keys=[KEY]), "tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


@torch.inference_mode()
def full_logits(engine, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab): the model's logits at every position, one forward without any cache."""
    tokens = torch.tensor([ids])
    return engine.model(tokens, torch.arange(len(ids))[None]).float()[0]


def ids_of(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


# ---- prompt shapes ---------------------------------------------------------------------------------


def test_token_id_prompt_and_prompt_batches_match_single_requests(engine, client):
    prompts = [PROMPT, "Hello there", "ab"]
    references = [engine.generate(p, max_new_tokens=5).text for p in prompts]
    single = client.completions.create(model="tiny", prompt=ids_of(engine, PROMPT), max_tokens=5)
    assert single.choices[0].text == references[0]
    for batch in (prompts, [ids_of(engine, p) for p in prompts]):
        out = client.completions.create(model="tiny", prompt=batch, max_tokens=5)
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert [c.text for c in out.choices] == references
        assert out.usage.prompt_tokens == sum(len(ids_of(engine, p)) for p in prompts)


def test_chat_content_parts_are_the_joined_text(engine, client):
    reference = engine.chat([{"role": "user", "content": "Hi there"}], max_new_tokens=5).text
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=5)
    assert out.choices[0].message.content == reference


def test_n_choices_are_the_seeded_samples_and_seed_repeats(engine, client):
    def sample(**kw):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, **kw)

    both = sample(n=2, seed=7)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [sample(seed=7).choices[0].text, sample(seed=8).choices[0].text]
    assert both.choices[0].text != both.choices[1].text
    assert both.usage.completion_tokens == 16 and both.usage.prompt_tokens == len(ids_of(engine, PROMPT))
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=3, temperature=1.0, seed=3
    )
    assert len({c.message.content for c in chat.choices}) > 1


def test_stream_of_a_batch_tags_each_choice(engine, client):
    prompts = [PROMPT, "Hello there"]
    references = [engine.generate(p, max_new_tokens=4).text for p in prompts]
    texts = ["", ""]
    usage = None
    for chunk in client.completions.create(
        model="tiny", prompt=prompts, max_tokens=4, stream=True, stream_options={"include_usage": True}
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == references and usage.completion_tokens == 8


# ---- where generation ends ---------------------------------------------------------------------------


def eos_id(engine) -> int:
    return min(engine.tokenizer.eos_ids)


def test_ignore_eos_reaches_max_tokens_and_min_tokens_holds_eos_back(engine, client):
    forced_eos = {str(eos_id(engine)): 100}  # EOS first at every step
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logit_bias=forced_eos)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 0
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, logit_bias=forced_eos, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, logit_bias=forced_eos, extra_body={"min_tokens": 3}
    )
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 3


def test_stop_token_ids_end_the_request_at_that_token(engine, client):
    reference = engine.generate(PROMPT, max_new_tokens=8)
    stop = reference.token_ids[3]
    cut = reference.token_ids.index(stop)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, extra_body={"stop_token_ids": [stop]})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == cut and out.choices[0].text == engine.tokenizer.decode(
        reference.token_ids[:cut]
    )


# ---- penalties and logit bias against a reference decode ----------------------------------------------


def reference_decode(
    engine,
    prompt_ids: list[int],
    steps: int,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    bias: dict[int, float] | None = None,
) -> list[int]:
    """Greedy decode with OpenAI's definitions, each step's logits from a full forward of the whole text."""
    out: list[int] = []
    for _ in range(steps):
        logits = full_logits(engine, prompt_ids + out)[-1].clone()
        for token, value in (bias or {}).items():
            logits[token] += value
        for token in set(prompt_ids + out):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(torch.argmax(logits)))
    return out


@pytest.mark.parametrize(
    "penalties",
    [
        {"frequency_penalty": 1.5},
        {"presence_penalty": 1.5},
        {"repetition_penalty": 1.8},
        {"logit_bias": {"65": 6.0, "66": -3.0}},
    ],
)
def test_penalties_and_logit_bias_change_the_output_as_defined(engine, client, penalties):
    prompt_ids = ids_of(engine, PROMPT)
    names = {"frequency_penalty": "frequency", "presence_penalty": "presence", "repetition_penalty": "repetition"}
    kwargs = {names[k]: v for k, v in penalties.items() if k in names}
    if "logit_bias" in penalties:
        kwargs["bias"] = {int(k): v for k, v in penalties["logit_bias"].items()}
    expected = reference_decode(engine, prompt_ids, 12, **kwargs)
    plain = reference_decode(engine, prompt_ids, 12)
    assert expected != plain  # the penalty matters for this prompt
    official = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
    extra = {"repetition_penalty": penalties["repetition_penalty"]} if "repetition_penalty" in penalties else {}
    out = client.completions.create(
        model="tiny", prompt=prompt_ids, max_tokens=12, logprobs=0, extra_body={**extra, "ignore_eos": True}, **official
    )
    assert out.choices[0].text == engine.tokenizer.decode(expected)


# ---- echo and logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [5, 29])  # 29 tokens: four prefill chunks of at most 8
def test_echo_logprobs_are_the_models_log_softmax_of_the_prompt(engine, client, length):
    text = (PROMPT * 3)[:length]
    ids = ids_of(engine, text)
    logprobs = torch.log_softmax(full_logits(engine, ids), dim=-1)
    expected = [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]
    out = client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=0, echo=True, logprobs=2)
    first, short = out.choices
    assert first.text == text and first.finish_reason == "length" and out.usage.completion_tokens == 0
    got = first.logprobs.token_logprobs
    assert got[0] is None and got[1:] == pytest.approx(expected, abs=1e-4)
    assert first.logprobs.tokens == [engine.tokenizer.decode([i]) for i in ids]
    best = logprobs[:-1].max(dim=-1).values  # (byte-piece tokens may share a text, so compare the best one)
    assert [max(top.values()) for top in first.logprobs.top_logprobs[1:]] == pytest.approx(best.tolist(), abs=1e-4)
    assert short.logprobs.token_logprobs[1:] == pytest.approx(expected[:2], abs=1e-4)


def test_a_stop_token_ends_the_logprobs_as_lm_eval_reads_them(engine, client):
    """lm-eval sends echo, max_tokens=1, logprobs=1 and drops the last entry as the generated token's: a
    generated EOS must therefore be listed too (its logprob the model's own, before the bias)."""
    ids = ids_of(engine, PROMPT)
    out = client.completions.create(
        model="tiny", prompt=ids, max_tokens=1, echo=True, logprobs=1, logit_bias={str(eos_id(engine)): 100}
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.text == PROMPT and out.usage.completion_tokens == 0
    logprobs = torch.log_softmax(full_logits(engine, ids), dim=-1)
    expected = [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))] + [float(logprobs[-1, eos_id(engine)])]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)


def test_generated_logprobs_on_both_routes(engine, client):
    prompt_ids = ids_of(engine, PROMPT)
    out = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=4, echo=True, logprobs=1)
    all_ids = prompt_ids + engine.generate(prompt_ids, max_new_tokens=4).token_ids
    logprobs = torch.log_softmax(full_logits(engine, all_ids), dim=-1)
    expected = [float(logprobs[i - 1, all_ids[i]]) for i in range(1, len(all_ids))]
    assert out.choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)

    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, logprobs=True, top_logprobs=3)
    reference = engine.chat(messages, max_new_tokens=4)
    chat_ids = engine.encode_prompt("", messages=messages) + reference.token_ids
    logprobs = torch.log_softmax(full_logits(engine, chat_ids), dim=-1)
    n = len(reference.token_ids)
    entries = chat.choices[0].logprobs.content
    assert [e.logprob for e in entries] == pytest.approx(
        [float(logprobs[-n - 1 + i, t]) for i, t in enumerate(reference.token_ids)], abs=1e-4
    )
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)


# ---- refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "route,extra,param",
    [
        ("chat", {"functions": [{"name": "f"}]}, "functions"),
        ("chat", {"response_format": {"type": "xml"}}, "response_format"),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
        ),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("completions", {"suffix": "end"}, "suffix"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("completions", {"n": 17}, "n"),
        ("completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ],
)
def test_unsupported_fields_are_refused_by_name(client, route, extra, param):
    base = (
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        if route == "chat"
        else {"prompt": PROMPT, "max_tokens": 2}
    )
    create = client.chat.completions.create if route == "chat" else client.completions.create
    body = {**base, **extra}
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        create(
            model="tiny",
            **{k: v for k, v in body.items() if k in ("messages", "prompt", "max_tokens")},
            extra_body={k: v for k, v in body.items() if k not in ("messages", "prompt", "max_tokens")},
        )
    error = caught.value.body
    assert error["code"] == "invalid_request" and error["type"] == "invalid_request_error"
    assert error["param"] == param and param in error["message"]


# ---- models, tokenize, detokenize ----------------------------------------------------------------------


def test_model_card_and_tokenize_round_trip(engine, client):
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.model_extra["max_model_len"] == engine.config.max_seq_len
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("other")
    assert caught.value.body["code"] == "not_found" and caught.value.body["param"] == "model"

    def post(path, body):  # vLLM's routes sit beside /v1, not under it
        root = str(client.base_url).rstrip("/").removesuffix("/v1")
        r = httpx.post(f"{root}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
        return r.json()

    out = post("/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert out["tokens"] == ids_of(engine, PROMPT) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == engine.config.max_seq_len and len(out["token_strs"]) == out["count"]
    messages = [{"role": "user", "content": "Hi"}]
    assert post("/tokenize", {"messages": messages})["tokens"] == engine.encode_prompt("", messages=messages)
    assert post("/detokenize", {"tokens": out["tokens"]}) == {"prompt": PROMPT}
