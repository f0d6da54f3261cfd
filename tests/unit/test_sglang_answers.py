"""The error table of app/sglang/errors.py held against SGLang 0.5.23's own raise sites (read
from the wheel's source) and against map_http_error: each answer the table names is one the
wheel makes, with the status it names, and maps to what the table says."""

from __future__ import annotations

import ast
import json
import zipfile
from functools import cache
from http import HTTPStatus

import pytest

from app.core.errors import BackPressure, PermanentError, RetryableError, ServerRefusal
from app.sglang import errors
from tests.support.sglang_contract import CACHE_DIR, SGLANG_VERSION, _wheel


@cache
def wheel_source(member: str) -> str:
    with zipfile.ZipFile(_wheel(CACHE_DIR, SGLANG_VERSION)) as wheel:
        return wheel.read(member).decode("utf-8")


def enclosing_function(source: str, text: str) -> str:
    """The source of the innermost function whose body holds text."""
    at = source.index(text)
    line = source.count("\n", 0, at) + 1
    best: ast.AST | None = None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            end = node.end_lineno or node.lineno
            if node.lineno <= line <= end and (
                best is None or node.lineno >= best.lineno  # type: ignore[attr-defined]
            ):
                best = node
    assert best is not None, f"{text!r} is in no function"
    return ast.get_source_segment(source, best) or ""


ROWS = [a for a in errors.SGLANG_ANSWERS if a.raised_in is not None]


@pytest.mark.parametrize("answer", ROWS, ids=[a.case for a in ROWS])
def test_each_answer_is_raised_by_the_wheel(answer: errors.SGLangAnswer) -> None:
    assert answer.raised_in is not None
    source = wheel_source(answer.raised_in)
    assert answer.raise_site in source, f"{answer.raised_in} no longer has {answer.raise_site!r}"


def test_the_queue_limit_aborts_with_503() -> None:
    scheduler = wheel_source("sglang/srt/managers/scheduler.py")
    body = enclosing_function(scheduler, 'message = "The request queue is full."')
    assert body.lstrip().startswith("def _abort_on_queued_limit")
    assert '"status_code": HTTPStatus.SERVICE_UNAVAILABLE' in body
    assert HTTPStatus.SERVICE_UNAVAILABLE == 503
    # a non-stream abort with a status other than 400 is an HTTPException of that status,
    # whose handler answers the error object the table names
    manager = wheel_source("sglang/srt/managers/tokenizer_manager.py")
    handler = enclosing_function(
        manager, 'status_code=status_code, detail=finish_reason["message"]'
    )
    assert "if status_code == HTTPStatus.BAD_REQUEST:" in handler
    server = wheel_source("sglang/srt/entrypoints/http_server.py")
    assert 'object="error",\n        message=exc.detail,\n        type=str(exc.status_code)' in (
        server
    )


def test_health_answers_503_while_draining_and_generate_does_not_check() -> None:
    server = wheel_source("sglang/srt/entrypoints/http_server.py")
    health = enclosing_function(server, "if _global_state.tokenizer_manager.gracefully_exit:")
    assert '@app.get("/health")' in server.split("async def health_generate")[0][-200:]
    assert "return Response(status_code=503)" in health
    manager = wheel_source("sglang/srt/managers/tokenizer_manager.py")
    generate = enclosing_function(manager, "async def generate_request(")
    assert "gracefully_exit" not in generate  # /generate keeps serving while draining
    watchdog = enclosing_function(manager, "async def sigterm_watchdog(self):")
    assert "remain_num_req = len(self.rid_to_state)" in watchdog


def test_the_api_key_check_answers_401_and_lets_health_through() -> None:
    auth = wheel_source("sglang/srt/utils/auth.py")
    assert "error_status_code: int = 401" in auth
    for route in ('path.startswith("/health")', 'path.startswith("/ready")'):
        assert route in auth  # probes pass without the key (the emulator does the same)


def test_context_length_checks_are_value_errors_answered_400() -> None:
    manager = wheel_source("sglang/srt/managers/tokenizer_manager.py")
    check = enclosing_function(manager, "Requested token count exceeds the model's maximum")
    assert "raise ValueError(error_msg)" in check
    server = wheel_source("sglang/srt/entrypoints/http_server.py")
    handler = enclosing_function(server, 'status_code=getattr(e, "status_code"')
    assert '{"error": {"message": str(e)}}' in handler


@pytest.mark.parametrize(
    "answer", errors.SGLANG_ANSWERS, ids=[a.case for a in errors.SGLANG_ANSWERS]
)
def test_each_answer_maps_as_the_table_says(answer: errors.SGLangAnswer) -> None:
    mapped = errors.map_http_error(answer.status, answer.body)
    assert type(mapped) is answer.means, (answer.case, mapped)
    spends = isinstance(mapped, PermanentError | RetryableError) and not isinstance(
        mapped, BackPressure | ServerRefusal
    )
    assert spends is answer.spends_attempt


@pytest.mark.parametrize(
    ("message", "means"),
    [
        ("The input (40 tokens) is longer than the model's context length (32 tokens).", True),
        ("Input length (40 tokens) exceeds the maximum allowed length (26 tokens).", True),
        ("Token id 163840 is out of vocabulary (vocab size 163840).", True),
        ("input_ids cannot be empty.", False),
        ("top_p must be in (0, 1], got 1.5.", False),
        ("Failed to load image: cannot identify image file", False),
    ],
)
def test_a_400_about_the_servers_limits_or_vocabulary_can_depend_on_the_server(
    message: str, means: bool
) -> None:
    mapped = errors.map_http_error(400, json.dumps({"error": {"message": message}}))
    assert isinstance(mapped, PermanentError)
    assert isinstance(mapped, ServerRefusal) is means
