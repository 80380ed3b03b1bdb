"""Tool calls on /v1/chat/completions: the tools go to the model's own chat template; `tool_choice` required or a
named function becomes a grammar (engine/grammar.py) in the way the model's family writes a call; the output is
parsed back into `tool_calls`.

Two families of call syntax, told apart by the chat template:
- Hermes / Qwen: each call a JSON object {"name", "arguments"} between <tool_call> and </tool_call> lines (the
  default, also for templates that name no syntax);
- Llama 3: the reply is one JSON object {"name", "parameters"} (after an optional <|python_tag|>).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from inferlab.engine.grammar import Constraint
from inferlab.errors import InvalidRequestError
from inferlab.server.schemas import ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCall, ToolDefinition

HERMES, LLAMA3 = "hermes", "llama3"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


def family(chat_template: str | None) -> str:
    """The call syntax the template's model was trained on."""
    template = chat_template or ""
    if "<tool_call>" not in template and (PYTHON_TAG in template or "ipython" in template):
        return LLAMA3
    return HERMES


@dataclass
class ToolUse:
    """A chat request's tools, how it may use them, and how its model writes a call."""

    tools: list[ToolDefinition]
    choice: str | NamedToolChoice  # "auto" | "required" | a named function
    family: str
    parallel: bool = True  # required: one call or several

    def constraint(self) -> Constraint | None:
        """What tool_choice enforces: required, a call of any of the tools; named, a call of that one (an invalid
        parameters schema is the `tools` field's fault)."""
        if self.choice == "auto":
            return None
        tools = self.tools
        if isinstance(self.choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == self.choice.function.name]
        arguments = "parameters" if self.family == LLAMA3 else "arguments"
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    arguments: t.function.parameters or {"type": "object"},
                },
                "required": ["name", arguments],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema = json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls}, separators=(",", ":"))
        if self.family == LLAMA3:
            return Constraint("grammar", f"start: %json {schema}", "tools")
        call = f'"<tool_call>\\n" %json {schema} "\\n</tool_call>"'
        repeat = ' ("\\n" call)*' if self.parallel and not isinstance(self.choice, NamedToolChoice) else ""
        return Constraint("grammar", f"start: call{repeat}\ncall: {call}", "tools")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's text outside its calls (None if nothing is left) and its calls; a reply whose calls do not
        parse is all text."""
        found = self._calls(text)
        if found is None:
            return text, []
        rest = HERMES_CALL.sub("", text).strip() if self.family == HERMES else ""
        calls = [
            ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=json.dumps(args)))
            for name, args in found
        ]
        return rest or None, calls

    def _calls(self, text: str) -> list[tuple[str, Any]] | None:
        if self.family == LLAMA3:
            bodies = [text.strip().removeprefix(PYTHON_TAG)]
        else:
            bodies = HERMES_CALL.findall(text)
        calls = []
        for body in bodies:
            try:
                call = json.loads(body)
            except ValueError:
                return None
            arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
            if not isinstance(call.get("name") if isinstance(call, dict) else None, str) or arguments is None:
                return None
            calls.append((call["name"], arguments))
        return calls or None


def tool_use(body: ChatCompletionRequest, chat_template: str | None) -> ToolUse | None:
    """The request's tool use, or None (no tools, or tool_choice none); a choice that names no tool is refused."""
    choice = body.tool_choice or ("auto" if body.tools else "none")
    if not body.tools:
        if choice not in ("none", "auto"):
            raise InvalidRequestError("tool_choice: required or a named function needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in body.tools]
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequestError(f"tool_choice: no tool is named {choice.function.name!r}", param="tool_choice")
    if choice == "none":
        return None
    return ToolUse(body.tools, choice, family(chat_template), body.parallel_tool_calls is not False)


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as chat templates read them (the OpenAI shape, parameters as a JSON schema)."""
    if not body.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]
