"""Request and response bodies. The static limits live here (so the OpenAPI schema states them); the
configurable caps (max_new_tokens_cap, max_prompt_chars) are checked in `streams.prepare` and written
into the schema by server/openapi.py. Numbers and booleans must be JSON numbers and booleans: lax
Pydantic would read "0.5", `true` or 1 as each other, which the schema does not allow."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, WithJsonSchema

from inferlab.engine.sampling import MAX_LOGPROBS


def _utf8(text: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"); the tokenizer cannot, so refuse them here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid UTF-8 (no lone surrogates)") from None
    return text


def _json_number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("should be a number")
    return value


Number = BeforeValidator(_json_number)
Text = Annotated[str, AfterValidator(_utf8)]
Prompt = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
MaxTokens = Annotated[int, Field(ge=1), Number] | None  # at most server.max_new_tokens_cap
Temperature = Annotated[float, Field(ge=0.0, le=2.0), Number] | None
TopP = Annotated[float, Field(gt=0.0, le=1.0), Number] | None
TopK = Annotated[int, Field(ge=0), Number] | None
Seed = Annotated[int, Field(ge=0, le=2**53 - 1), Number] | None  # integers a JSON number holds exactly
StopString = Annotated[str, Field(max_length=64), AfterValidator(_utf8)]
Stop = StopString | Annotated[list[StopString], Field(max_length=4)] | None


class Sampling(BaseModel):
    """The generation knobs every route shares; None = the engine's default from conf/."""

    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    seed: Seed = None
    stop: Stop = Field(default=None, description="stop strings (at most 4)")

    def sampling_overrides(self) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": stop,
        }


# ---- native API ----------------------------------------------------------------------------------


class GenerateRequest(Sampling):
    model_config = ConfigDict(extra="forbid")

    prompt: Prompt
    max_new_tokens: MaxTokens = None
    chat: StrictBool = Field(
        default=False, description="wrap the prompt as a user message in the model's chat template"
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateResponse(BaseModel):
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    ttft_ms: float
    tpot_ms: float
    tokens_per_sec: float
    total_ms: float


class ErrorBody(BaseModel):
    code: str
    message: str
    type: str = Field(description="OpenAI's error type: invalid_request_error, authentication_error, ...")
    param: str | None = Field(default=None, description="the request field at fault, when one is")


class ErrorEnvelope(BaseModel):
    error: ErrorBody


# ---- OpenAI-compatible API ------------------------------------------------------------------------
# Unknown fields that change nothing (user, metadata, ...) are ignored so existing clients and load tools
# work; fields that would change the answer and are not implemented are refused by name (`Unsupported`).


def _refuse(value: Any) -> Any:
    if value is not None:
        raise ValueError("not supported by this server")
    return value


Unsupported = Annotated[
    Any, AfterValidator(_refuse), WithJsonSchema({"type": "null"}), Field(description="not supported: refused when set")
]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0), Number] | None
TokenId = Annotated[int, Field(ge=0), Number]  # below the vocabulary size: server/openapi.py states it
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Number] | None
CompletionMaxTokens = Annotated[int, Field(ge=0), Number] | None  # 0: echo only; at most server.max_new_tokens_cap
MAX_CHOICES = 16  # prompts x n engine requests one call may start
TOKEN_KEY = r"^[0-9]{1,9}$"
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=TOKEN_KEY)], Annotated[float, Field(ge=-100, le=100), Number]],
    WithJsonSchema(
        {
            "type": "object",
            "propertyNames": {"pattern": TOKEN_KEY},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        }
    ),
]


JsonSchemaText = dict[str, Any] | Annotated[str, Field(min_length=1, max_length=65536)]  # a schema, or its JSON text
GrammarText = Annotated[str, Field(min_length=1, max_length=65536), AfterValidator(_utf8)]
Choices = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=1024), AfterValidator(_utf8)]],
    Field(min_length=1, max_length=256),
]


class JsonSchemaFormat(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema", description="the JSON schema to match")
    strict: StrictBool | None = Field(default=None, description="the schema is always enforced, strict or not")


class ResponseFormat(BaseModel):
    """OpenAI's: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    model_config = ConfigDict(extra="forbid")

    json_: JsonSchemaText | None = Field(default=None, alias="json")
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None
    json_object: StrictBool | None = None


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON schema of the arguments object")
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class OpenAIRequest(Sampling):
    """What both OpenAI routes share, vLLM's extensions included (min_tokens, ignore_eos, stop_token_ids,
    repetition_penalty, top_k)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES), Number] = Field(
        default=1, description=f"choices per prompt; prompts x n at most {MAX_CHOICES}"
    )
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0), Number] | None = None
    logit_bias: LogitBias | None = Field(
        default=None, description="token id -> bias added to its logit (ids outside the vocabulary change nothing)"
    )
    min_tokens: Annotated[int, Field(ge=0), Number] = 0
    ignore_eos: StrictBool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=16)] | None = None
    functions: Unsupported = None
    function_call: Unsupported = None
    best_of: Unsupported = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchemaText | None = Field(default=None, description="vLLM's: a JSON schema the output matches")
    guided_regex: GrammarText | None = Field(default=None, description="vLLM's: a regex the output matches")
    guided_choice: Choices | None = Field(default=None, description="vLLM's: the output is one of these strings")
    guided_grammar: GrammarText | None = Field(default=None, description="vLLM's: a Lark or GBNF grammar")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_overrides(self) -> dict[str, Any]:
        return {
            **super().sampling_overrides(),
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": {int(k): v for k, v in (self.logit_bias or {}).items()},
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids or [],
        }


ECHO_ONLY = {
    "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},  # 0 only with echo
    "then": {"required": ["echo"], "properties": {"echo": {"const": True}}},
}
CHOICES = [
    {
        "if": {
            "required": ["prompt"],  # a batch of k prompts allows n up to MAX_CHOICES // k
            "properties": {"prompt": {"type": "array", "minItems": k, "items": {"type": ["string", "array"]}}},
        },
        "then": {"properties": {"n": {"maximum": MAX_CHOICES // k}}},
    }
    for k in range(2, MAX_CHOICES + 1)
]


class CompletionRequest(OpenAIRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [ECHO_ONLY, *CHOICES]})

    prompt: (
        Prompt
        | TokenIds
        | Annotated[list[Prompt], Field(min_length=1, max_length=MAX_CHOICES)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)]
    )
    max_tokens: CompletionMaxTokens = None
    echo: StrictBool = Field(default=False, description="the prompt's text (and logprobs) before the completion")
    logprobs: TopLogprobs = Field(default=None, description="log-probabilities of each token and this many top ones")
    suffix: Unsupported = None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt (text or token ids) per entry."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments object as JSON text")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)] | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, description="an assistant's earlier calls")
    tool_call_id: str | None = Field(default=None, description="a tool message: the call it answers")

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it: the text parts joined into one string; an assistant's tool calls
        with their arguments as objects (templates write them out as JSON themselves)."""
        content = self.content or ""
        message: dict[str, Any] = {
            "role": self.role,
            "content": content if isinstance(content, str) else "".join(p.text for p in content),
        }
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _loads(c)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _loads(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


class ChatCompletionRequest(OpenAIRequest):
    model_config = ConfigDict(
        json_schema_extra={  # top_logprobs only with logprobs
            "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        }
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=256)]
    max_tokens: MaxTokens = None
    max_completion_tokens: MaxTokens = None
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs = None
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = Field(default=None, description="auto when tools are given, else none")
    parallel_tool_calls: StrictBool | None = None
    audio: Unsupported = None
    prediction: Unsupported = None


class LogprobsBlock(BaseModel):
    """Completions' logprobs: one entry per token (the prompt's first has no logprob: null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: LogprobsBlock | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda calls: calls is None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
