"""vLLM's `POST /tokenize` and `POST /detokenize`: the server's own tokenizer (and chat template) for
clients that count or build prompts in token ids (lm-eval, benchmark tools)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from inferlab.engine.engine import InferenceEngine
from inferlab.errors import InvalidRequestError
from inferlab.server.schemas import ChatMessage, Text, TokenId


class TokenizeRequest(BaseModel):
    """Raw text (`prompt`) or chat `messages` rendered with the model's template, as vLLM takes them."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "oneOf": [  # exactly one of the two
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        },
    )

    model: str | None = None
    prompt: Annotated[Text, Field(max_length=65536)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=256)] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=65536)]


class DetokenizeResponse(BaseModel):
    prompt: str


def router(engine: InferenceEngine, errors: dict[int, Any], max_prompt_chars: int) -> APIRouter:
    """`max_prompt_chars`: messages are held to the chat route's limit (their schema is shared)."""
    routes = APIRouter(responses=errors)
    tokenizer = engine.tokenizer

    @routes.post("/tokenize")
    def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            messages = [m.as_template_input() for m in body.messages]
            chars = sum(len(m["content"]) for m in messages)
            if chars > max_prompt_chars:
                raise InvalidRequestError(
                    f"messages: {chars} characters, more than this server's {max_prompt_chars}", param="messages"
                )
            try:
                text = tokenizer.render_chat(messages, body.add_generation_prompt)
            except ValueError as e:
                raise InvalidRequestError(str(e).splitlines()[0], param="messages") from None
            ids = tokenizer.encode(text)
        else:
            ids = (
                tokenizer.encode(body.prompt)
                if body.add_special_tokens
                else tokenizer.backend.encode(body.prompt, add_special_tokens=False).ids
            )
        strs = [tokenizer.token_text(i) for i in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.config.max_seq_len, tokens=ids, token_strs=strs)

    @routes.post("/detokenize")
    def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        vocab = engine.loaded.config.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    return routes
