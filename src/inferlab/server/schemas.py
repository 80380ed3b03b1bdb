"""Request and response bodies. The static limits live here (so the OpenAPI schema states them); the
configurable caps (max_new_tokens_cap, max_prompt_chars) are checked in `streams.prepare`."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _utf8(text: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"); the tokenizer cannot, so refuse them here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid UTF-8 (no lone surrogates)") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
Prompt = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
MaxTokens = Annotated[int | None, Field(ge=1)]  # at most server.max_new_tokens_cap
Temperature = Annotated[float | None, Field(ge=0.0, le=2.0)]
TopP = Annotated[float | None, Field(gt=0.0, le=1.0)]
TopK = Annotated[int | None, Field(ge=0)]
Seed = Annotated[int | None, Field(ge=0, le=2**63 - 1)]
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
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": stop}


# ---- native API ----------------------------------------------------------------------------------

class GenerateRequest(Sampling):
    model_config = ConfigDict(extra="forbid")

    prompt: Prompt
    max_new_tokens: MaxTokens = None
    chat: bool = Field(default=False, description="wrap the prompt as a user message in the model's chat template")


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


class ErrorEnvelope(BaseModel):
    error: ErrorBody


# ---- OpenAI-compatible API (unknown fields are ignored so existing clients and load tools work) -----

class StreamOptions(BaseModel):
    include_usage: bool = False


class OpenAIRequest(Sampling):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAIRequest):
    prompt: Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=1)]
    max_tokens: MaxTokens = None

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Text


class ChatCompletionRequest(OpenAIRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=256)]
    max_tokens: MaxTokens = None
    max_completion_tokens: MaxTokens = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
