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
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from app.core.errors import ConfigurationError, InputError, TokenmillError
from app.prompts.chat_path import (
    ChatInputs,
    bare_function_tools,
    final_assistant_as_user,
    merge_template_kwargs,
    normalize_messages,
    normalize_tools,
    template_view,
)
from app.prompts.tokenization import ChatTokenizer

logger = logging.getLogger(__name__)

# ORJSON writes 64-bit integers only; a larger model_max_length is replaced by the context
_INT64_RANGE = (-(2**63), 2**64)
_GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
NO_TOKENIZER = (
    "Chat template tokenization requires a template manager. "
    "(the emulator was started without --tokenizer DIR)"
)


class TokenizeFailure(TokenmillError, ValueError):
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


class _ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = "auto"
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    max_long_side_pixel: int | None = None
    content_hash: str | None = None


class _ImagePart(BaseModel):
    """An image part: rendered as the template renders an image (the image is not read: the
    rendered ids hold one placeholder per image, which /generate expands)."""

    type: Literal["image_url"]
    image_url: _ImageURL
    modalities: Literal["image", "multi-images", "video"] | None = "image"


class _MediaPart(BaseModel):
    """Video and audio parts: accepted by shape; the chat path refuses them (a 400)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["video_url", "audio_url", "input_audio", "tool_reference"]


_Part = _TextPart | _ThinkingPart | _ImagePart | _MediaPart


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


class _ToolChoiceName(BaseModel):
    name: str | None = None


class _ToolChoice(BaseModel):
    function: _ToolChoiceName
    type: Literal["function"] = "function"


_EffortTier = Literal["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"]


class TokenizeBody(BaseModel):
    """POST /v1/tokenize: exactly one of `prompt` and `messages`."""

    model_config = ConfigDict(extra="allow")

    model: str = "default"
    prompt: str | list[str] | None = None
    messages: list[_GenericMessage | _UserMessage] | None = None
    tools: list[_Tool] | None = None
    tool_choice: Literal["auto", "required", "none"] | _ToolChoice | None = None
    reasoning_effort: _EffortTier | Annotated[float, Field(ge=0.0, le=0.99)] | None = None
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


# --- the chat path -------------------------------------------------------------------------------


def dump_messages(
    messages: Sequence[_GenericMessage | _UserMessage], raw: Sequence[Any]
) -> list[dict[str, Any]]:
    """Each message as its model dumps it: declared fields only (others are dropped), defaults
    included; a system turn's tools as given, for the chat path to shape."""
    out = []
    for message, source in zip(messages, raw, strict=True):
        data = message.model_dump()
        if isinstance(message, _GenericMessage) and message.tools is not None:
            data["tools"] = list(source.get("tools") or [])
        out.append(data)
    return out


def render_chat_ids(
    tokenizer: ChatTokenizer,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any],
    add_generation_prompt: bool | None,
    add_special_tokens: bool,
    continue_final_message: bool = False,
) -> list[int]:
    """tokenmill's reproduction of the chat path (app.prompts.chat_path) on the validated request.

    add_generation_prompt None is a chat completion's rendering (`ChatTokenizer.apply_each`):
    a final assistant turn with string content is sent as a user turn, or with
    continue_final_message its text is appended to the prompt. Given, add_generation_prompt
    goes to the template as is and the text is encoded with add_special_tokens.
    """
    try:
        turns = normalize_messages(messages, tokenizer.content_format)
        shaped = normalize_tools(tools) if tools else None
        prefix = None
        if add_generation_prompt is None or continue_final_message:
            last = turns[-1] if turns else {}
            if not continue_final_message:
                turns = final_assistant_as_user(turns)
            elif last.get("role") == "assistant" and isinstance(last.get("content"), str):
                prefix, turns = str(last["content"]), turns[:-1]
        if add_generation_prompt is None:
            # the continued turn appended as the product appends it (an answer before it kept)
            inputs = ChatInputs(
                turns, shaped, chat_template_kwargs, normalized=True, assistant_prefix=prefix
            )
            [ids] = tokenizer.apply_each([inputs])
            if isinstance(ids, InputError):
                raise ids
            return ids
        ids = _render_as_asked(
            tokenizer,
            turns,
            shaped,
            chat_template_kwargs,
            add_generation_prompt,
            add_special_tokens,
        )
        if prefix:
            hf = tokenizer.hf_tokenizer
            encoded = [int(i) for i in hf.encode(prefix)]
            if encoded and encoded[0] == hf.bos_token_id:
                encoded = encoded[1:]
            ids = ids + encoded
        return ids
    except (InputError, ConfigurationError) as exc:
        raise TokenizeFailure(str(exc).removeprefix("chat template failed: ")) from exc
    except TokenizeFailure:
        raise
    except (TypeError, ValueError, LookupError) as exc:  # a template's own errors are a 400
        raise TokenizeFailure(str(exc)) from exc


def _render_as_asked(
    tokenizer: ChatTokenizer,
    turns: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any],
    add_generation_prompt: bool,
    add_special_tokens: bool,
) -> list[int]:
    hf = tokenizer.hf_tokenizer
    shown = template_view(turns)  # each image part as {"type": "image"}, as SGLang hands it

    def render(tool_list: list[dict[str, Any]] | None) -> str:
        return str(
            hf.apply_chat_template(
                shown,
                tools=tool_list,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **chat_template_kwargs,
            )
        )

    try:
        text = render(tools)
    except Exception:
        if not tools:
            raise
        text = render(bare_function_tools(tools))
    return [int(i) for i in hf.encode(text, add_special_tokens=add_special_tokens)]


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
    """Answer one /v1/tokenize body as SGLang 0.5.23 does (200, or 400/500 error objects),
    rendered with tokenmill's own chat path (logged with each chat request, at DEBUG)."""
    if isinstance(body, dict) and body.get("messages") is not None:
        logger.debug("/v1/tokenize: rendering with tokenmill's chat path, not SGLang's")
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
    # a request's reasoning_effort is a template variable and sets the thinking defaults
    kwargs = merge_template_kwargs(None, kwargs, request.reasoning_effort)
    if request.add_generation_prompt is False and request.continue_final_message:
        raise TokenizeFailure(
            "continue_final_message needs add_generation_prompt to open the assistant turn."
        )
    choice_error = _tool_choice_error(request)
    if choice_error:
        raise TokenizeFailure(choice_error)
    dumped = dump_messages(messages, body.get("messages") or [])
    tools = None
    if request.tools and request.tool_choice != "none":
        tools = list(body.get("tools") or [])
        if isinstance(request.tool_choice, _ToolChoice):  # only the chosen tool is rendered
            name = request.tool_choice.function.name
            chosen = zip(tools, request.tools, strict=True)
            tools = [raw for raw, tool in chosen if tool.function.name == name]
    add_generation_prompt = request.add_generation_prompt
    add_special_tokens = (
        add_generation_prompt is not None
        and "add_special_tokens" in request.model_fields_set
        and request.add_special_tokens
    )
    return render_chat_ids(
        tokenizer,
        dumped,
        tools=tools,
        chat_template_kwargs=kwargs,
        add_generation_prompt=add_generation_prompt,
        add_special_tokens=add_special_tokens,
        continue_final_message=request.continue_final_message,
    )


def _tool_choice_error(request: TokenizeBody) -> str | None:
    """SGLang's checks of tool_choice against the request's (and system turns') tools."""
    tools = [t.function.name for t in request.tools or []]
    for message in request.messages or []:
        if isinstance(message, _GenericMessage) and message.role in ("root", "system", "developer"):
            tools += [t.function.name for t in message.tools or []]
    choice = request.tool_choice
    if choice == "required" and not tools:
        return "Tools cannot be empty if tool choice is set to required."
    if isinstance(choice, _ToolChoice):
        if not tools:
            return "Tools cannot be empty if tool choice is set to a specific tool."
        if choice.function.name not in tools:
            return f"Tool '{choice.function.name}' not found in tools list."
    return None


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


def answer_raw(
    content_type: str,
    raw: bytes,
    tokenizer: ChatTokenizer | None,
    context_length: int,
    *,
    tokenize_body: bool,
) -> TokenizeAnswer:
    """One HTTP request to /v1/tokenize (tokenize_body) or /v1/detokenize, from its content
    type and bytes: SGLang answers a body that is not `application/json` with a 400."""
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        message = (
            "1 validation error:\n  {'loc': ('header', 'content-type'), 'msg': "
            "\"Unsupported Media Type: Only 'application/json' is allowed\", "
            "'type': 'value_error'}"
        )
        return TokenizeAnswer(400, error_body(message, 400, "Bad Request"))
    try:
        body = json.loads(raw)
    except ValueError as exc:
        return TokenizeAnswer(400, error_body(f"JSON decode error: {exc}", 400, "Bad Request"))
    if tokenize_body:
        return tokenize(body, tokenizer, context_length)
    return detokenize(body, tokenizer)
