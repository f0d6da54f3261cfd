"""The emulator's `/v1/tokenize` and `/v1/detokenize`: SGLang 0.5.23's request shapes, its chat
path (messages rendered exactly as for a chat completion) and its error bodies.

Requests are validated the way SGLang's pydantic models do it: undeclared message fields are
dropped, declared ones are dumped with their defaults, then tokenmill's reproduction of the
chat path normalizes and renders them with the tokenizer folder given by `--tokenizer`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from app.tokenization import ChatTokenizer

logger = logging.getLogger(__name__)

# ORJSON writes 64-bit integers only; a larger model_max_length is replaced by the context
_INT64_RANGE = (-(2**63), 2**64)
_GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
NO_TOKENIZER = (
    "Chat template tokenization requires a template manager. "
    "(the emulator was started without --tokenizer DIR)"
)


class TokenizeFailure(ValueError):
    """A request SGLang answers with an error object: (status, message, type)."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type


# --- request models (the shapes SGLang's protocol accepts) ------------------------------------


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _ThinkingPart(BaseModel):
    type: Literal["thinking", "reasoning"]
    thinking: str | None = None
    text: str | None = None

    @model_validator(mode="after")
    def _one_payload(self) -> _ThinkingPart:
        if (self.thinking is None) == (self.text is None):
            raise ValueError("thinking parts require exactly one of 'thinking' or 'text'")
        return self


class _MediaPart(BaseModel):
    """Image, video and audio parts: accepted by shape, never rendered by the emulator."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "video_url", "audio_url", "input_audio", "tool_reference"]


_Part = _TextPart | _ThinkingPart | _MediaPart


def _has_thinking(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(p, _ThinkingPart) for p in content)


class _FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | dict[str, Any] | None = None


class _ToolCall(BaseModel):
    id: str | None = None
    index: int | None = None
    type: Literal["function"] = "function"
    function: _FunctionCall


class _Function(BaseModel):
    description: str | None = None
    name: str
    parameters: object | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class _Tool(BaseModel):
    type: str = "function"
    function: _Function
    defer_loading: bool | None = None


class _GenericMessage(BaseModel):
    role: str
    content: str | list[_Part] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    phase: Literal["commentary", "final_answer"] | None = None
    reasoning_content: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tools: list[_Tool] | None = None
    prefix: bool | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, value: Any) -> Any:
        if not isinstance(value, str):
            raise ValueError("'role' must be a string")
        if value.lower() not in _GENERIC_ROLES:
            allowed = ", ".join(repr(r) for r in _GENERIC_ROLES)
            raise ValueError(f"'role' must be one of {allowed} (case-insensitive).")
        return value.lower()

    @model_validator(mode="after")
    def _thinking_only_for_assistant(self) -> _GenericMessage:
        if self.role != "assistant" and _has_thinking(self.content):
            raise ValueError("thinking content parts are only valid in assistant messages")
        return self


class _UserMessage(BaseModel):
    role: Literal["user"]
    content: str | list[_Part]

    @model_validator(mode="after")
    def _no_thinking(self) -> _UserMessage:
        if _has_thinking(self.content):
            raise ValueError("thinking content parts are only valid in assistant messages")
        return self


class TokenizeBody(BaseModel):
    """POST /v1/tokenize: exactly one of `prompt` and `messages`."""

    model_config = ConfigDict(extra="allow")

    model: str = "default"
    prompt: str | list[str] | None = None
    messages: list[_GenericMessage | _UserMessage] | None = None
    tools: list[_Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("Exactly one of 'prompt' or 'messages' must be provided.")
        return self


class DetokenizeBody(BaseModel):
    model: str = "default"
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


# --- dumps: what SGLang hands its chat path -----------------------------------------------------


def _dump_function(function: _Function, given: Sequence[str]) -> dict[str, Any]:
    """Declared fields, given keys first in their order (templates render dicts as given);
    strict and defer_loading only when set."""
    data = function.model_dump()
    for key in ("defer_loading", "strict"):
        if data[key] is None:
            data.pop(key)
    order = [k for k in given if k in data]
    return {k: data[k] for k in [*order, *(k for k in data if k not in order)]}


def dump_tools(tools: Sequence[_Tool], raw: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for tool, source in zip(tools, raw, strict=True):
        given = list(source.get("function", {})) if isinstance(source, Mapping) else []
        if tool.defer_loading is not None and tool.function.defer_loading is None:
            tool.function.defer_loading = tool.defer_loading
        out.append(
            {
                "type": tool.type,
                "function": _dump_function(tool.function, given),
                "defer_loading": tool.defer_loading,
            }
        )
    return out


def dump_messages(
    messages: Sequence[_GenericMessage | _UserMessage], raw: Sequence[Any]
) -> list[dict[str, Any]]:
    """Each message as its model dumps it: declared fields only, defaults included."""
    out = []
    for message, source in zip(messages, raw, strict=True):
        data = message.model_dump(exclude={"tools"})
        if isinstance(message, _GenericMessage):
            source_tools = source.get("tools") if isinstance(source, Mapping) else None
            data["tools"] = (
                dump_tools(message.tools, source_tools or []) if message.tools is not None else None
            )
            # key order of the model's fields
            data = {name: data[name] for name in _GenericMessage.model_fields}
        out.append(data)
    return out


# --- rendering --------------------------------------------------------------------------------


def render_chat_ids(
    tokenizer: ChatTokenizer,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any],
    add_generation_prompt: bool,
    add_special_tokens: bool,
) -> list[int]:
    """The chat path after validation: normalize, render to text, encode the text."""
    normalized = [_normalize(message) for message in messages]
    hf = tokenizer.hf_tokenizer

    def render(tool_list: list[dict[str, Any]] | None) -> str:
        return str(
            hf.apply_chat_template(
                normalized,
                tools=tool_list,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **chat_template_kwargs,
            )
        )

    try:
        text = render(tools)
    except Exception:
        bare = [t.get("function", t) for t in tools] if tools else None
        try:
            text = render(bare)
        except Exception as exc:
            raise ValueError(str(exc)) from exc
    return [int(i) for i in hf.encode(text, add_special_tokens=add_special_tokens)]


def _normalize(message: dict[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if out.get("content") is None:
        out["content"] = ""
    for call in out.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                parsed = json.loads(function["arguments"])
            except ValueError as exc:
                raise TokenizeFailure(
                    "Assistant tool call function.arguments must be valid JSON."
                ) from exc
            if not isinstance(parsed, dict):
                raise TokenizeFailure(
                    "Assistant tool call function.arguments must be a JSON object."
                )
            function["arguments"] = parsed
    out = {k: v for k, v in out.items() if v is not None}
    content = out.get("content")
    if isinstance(content, list) and all(p.get("type") == "text" for p in content):
        out["content"] = " ".join(str(p.get("text", "")) for p in content)
    return out


# --- handlers -----------------------------------------------------------------------------------


def validation_message(exc: ValidationError) -> str:
    """The 400 text of a body the models refuse (the shape of SGLang's handler text)."""
    errors = [
        {"type": e["type"], "loc": ("body", *e["loc"]), "msg": e["msg"]} for e in exc.errors()
    ]
    count = len(errors)
    lines = "\n".join(f"  {error}" for error in errors)
    return f"{count} validation error{'s' if count != 1 else ''}:\n{lines}"


@dataclass
class TokenizeAnswer:
    status: int
    body: dict[str, Any]


def error_body(message: str, status: int, err_type: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}


def _max_model_len(tokenizer: ChatTokenizer | None, context_length: int) -> int:
    if tokenizer is None:
        return context_length
    value = getattr(tokenizer.hf_tokenizer, "model_max_length", -1)
    if isinstance(value, int) and _INT64_RANGE[0] <= value < _INT64_RANGE[1]:
        return value
    return context_length


def tokenize(body: Any, tokenizer: ChatTokenizer | None, context_length: int) -> TokenizeAnswer:
    """Answer one /v1/tokenize body as SGLang 0.5.23 does (200, or 400/500 error objects)."""
    try:
        request = TokenizeBody.model_validate(body)
    except ValidationError as exc:
        return TokenizeAnswer(400, error_body(validation_message(exc), 400, "Bad Request"))
    try:
        if tokenizer is None:
            raise TokenizeFailure(NO_TOKENIZER)
        max_len = _max_model_len(tokenizer, context_length)
        hf = tokenizer.hf_tokenizer
        if request.messages is not None:
            ids = _chat_ids(request, body, tokenizer)
            return TokenizeAnswer(200, {"tokens": ids, "count": len(ids), "max_model_len": max_len})
        if isinstance(request.prompt, str):
            ids = [
                int(i)
                for i in hf.encode(request.prompt, add_special_tokens=request.add_special_tokens)
            ]
            return TokenizeAnswer(200, {"tokens": ids, "count": len(ids), "max_model_len": max_len})
        rows = [
            [int(i) for i in hf.encode(text, add_special_tokens=request.add_special_tokens)]
            for text in request.prompt or []
        ]
        counts = [len(row) for row in rows]
        return TokenizeAnswer(200, {"tokens": rows, "count": counts, "max_model_len": max_len})
    except TokenizeFailure as exc:
        return TokenizeAnswer(exc.status, error_body(str(exc), exc.status, exc.err_type))
    except Exception as exc:  # a tokenizer failure SGLang reports as a 500
        logger.exception("tokenize failed")
        message = f"Internal server error during tokenization: {exc}"
        return TokenizeAnswer(500, error_body(message, 500, "InternalServerError"))


def _chat_ids(
    request: TokenizeBody, body: Mapping[str, Any], tokenizer: ChatTokenizer
) -> list[int]:
    messages = request.messages or []
    if not messages:
        raise TokenizeFailure("Messages cannot be empty.")
    kwargs = dict(request.chat_template_kwargs or {})
    if "chat_template" in kwargs:
        raise TokenizeFailure(
            "Request-supplied chat_template is not allowed. Start the server "
            "with --trust-request-chat-template to permit it."
        )
    if request.reasoning_effort is not None:
        kwargs = {"reasoning_effort": request.reasoning_effort, **kwargs}
    if request.add_generation_prompt is False and request.continue_final_message:
        raise TokenizeFailure(
            "continue_final_message needs add_generation_prompt to open the assistant turn."
        )
    dumped = dump_messages(messages, body.get("messages") or [])
    tools = None
    if request.tools and request.tool_choice != "none":
        tools = dump_tools(request.tools, body.get("tools") or [])
    add_generation_prompt = request.add_generation_prompt
    add_special_tokens = (
        add_generation_prompt is not None
        and "add_special_tokens" in request.model_fields_set
        and request.add_special_tokens
    )
    try:
        return render_chat_ids(
            tokenizer,
            dumped,
            tools=tools,
            chat_template_kwargs=kwargs,
            add_generation_prompt=add_generation_prompt is not False,
            add_special_tokens=add_special_tokens,
        )
    except ValueError as exc:
        raise TokenizeFailure(str(exc)) from exc


def detokenize(body: Any, tokenizer: ChatTokenizer | None) -> TokenizeAnswer:
    """Answer one /v1/detokenize body: `{"text": str | [str]}`."""
    try:
        request = DetokenizeBody.model_validate(body)
    except ValidationError as exc:
        return TokenizeAnswer(400, error_body(validation_message(exc), 400, "Bad Request"))
    if tokenizer is None:
        return TokenizeAnswer(400, error_body(NO_TOKENIZER, 400, "BadRequestError"))
    skip = request.skip_special_tokens
    try:
        tokens = request.tokens
        if not tokens:
            return TokenizeAnswer(200, {"text": ""})
        if isinstance(tokens[0], int):
            return TokenizeAnswer(200, {"text": tokenizer.decode(tokens, skip_special_tokens=skip)})
        texts = [tokenizer.decode(row, skip_special_tokens=skip) for row in tokens]
        return TokenizeAnswer(200, {"text": texts})
    except Exception as exc:
        if "decode" in str(exc).lower():
            message = f"Error decoding tokens: {exc}. Input tokens might be invalid for the model."
            return TokenizeAnswer(400, error_body(message, 400, "DecodeError"))
        message = f"Internal server error during detokenization: {exc}"
        return TokenizeAnswer(500, error_body(message, 500, "InternalServerError"))
