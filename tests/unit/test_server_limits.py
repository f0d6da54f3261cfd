"""The servers' own limits: the context length read from /server_info, which one a run holds
its prompts to, and the line a worker writes at start when its server's differs from the
model folder's config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest

from app.core.errors import AuthRequired, GenerationError, ServerUnavailable
from app.sglang import client as sglang_client
from app.sglang.limits import choose_context, context_length_of
from workers.engine.server_limits import context_line


class _Info:
    """A client whose /server_info answers with `info`, or raises `error`."""

    def __init__(self, info: dict[str, Any] | None = None, error: Exception | None = None):
        self.info = info or {}
        self.error = error

    def server_info(self) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        return self.info


def _client(info: dict[str, Any] | None = None, error: Exception | None = None) -> Any:
    return cast(sglang_client.SGLangClient, _Info(info, error))


def _folder(tmp_path: Path, config: dict[str, Any]) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        ({"context_length": 4096}, 4096),
        ({"max_model_len": 2048}, 2048),
        ({"context_length": 4096, "max_model_len": 2048}, 4096),
        ({"context_length": 0, "max_model_len": 1024}, 1024),
        ({"context_length": True}, None),
        ({"context_length": "4096"}, None),
        ({}, None),
    ],
)
def test_the_servers_context_length_is_a_positive_integer(
    info: dict[str, Any], expected: int | None
) -> None:
    assert context_length_of(info) == expected


def test_the_folder_holds_when_no_server_says() -> None:
    choice = choose_context({"gpu-a": None, "gpu-b": None}, 8192)
    assert (choice.context_length, choice.notice) == (8192, None)
    assert choose_context({}, None).context_length is None


def test_servers_that_agree_with_the_folder_say_nothing() -> None:
    choice = choose_context({"gpu-a": 8192, "gpu-b": None}, 8192)
    assert (choice.context_length, choice.notice) == (8192, None)


def test_the_smallest_server_wins_and_the_difference_is_named() -> None:
    choice = choose_context({"gpu-b": 4096, "gpu-a": 2048, "gpu-c": 8192}, 8192)
    assert choice.context_length == 2048
    assert choice.notice is not None
    # only the servers that differ, by name, in order; the folder's figure beside them
    assert "(gpu-a 2048, gpu-b 4096; their --context-length)" in choice.notice
    assert "config.json says 8192" in choice.notice
    assert choice.notice.endswith("prompts are held to 2048, the server's")


def test_a_folder_without_a_limit_is_named_as_giving_none() -> None:
    choice = choose_context({"gpu-a": 2048}, None)
    assert choice.context_length == 2048
    assert choice.notice is not None and "config.json gives none" in choice.notice


@pytest.mark.parametrize(
    "client",
    [
        _client({"model_path": "/x"}),
        _client(error=ServerUnavailable("connection refused")),
        _client(error=AuthRequired("401")),
    ],
    ids=["silent", "unanswered", "needs-a-key"],
)
def test_no_line_when_the_server_does_not_say(client: Any) -> None:
    assert context_line("gpu-a", client) is None


def test_the_line_names_the_servers_length_alone_when_the_folder_agrees(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"max_position_embeddings": 128})
    line = context_line("gpu-a", _client({"context_length": 128, "model_path": str(folder)}))
    assert line == "server gpu-a's context length is 128 (its --context-length)"


def test_the_line_names_a_folder_that_says_otherwise(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"text_config": {"max_position_embeddings": 262144}})
    line = context_line("gpu-a", _client({"context_length": 96, "model_path": str(folder)}))
    assert line is not None
    assert line.startswith("server gpu-a's context length is 96 (its --context-length), ")
    assert f"not the 262144 of its model folder's config.json ({folder})" in line
    assert line.endswith("`tokenmill enqueue` holds prompts to 96, the server's")


def test_a_model_path_not_on_this_node_is_not_compared(tmp_path: Path) -> None:
    """A hub id or a folder on another node: only the server's figure is said."""
    for model_path in ("org/model", str(tmp_path / "absent"), ""):
        line = context_line("gpu-a", _client({"context_length": 96, "model_path": model_path}))
        assert line == "server gpu-a's context length is 96 (its --context-length)"


def test_every_generation_error_means_no_line() -> None:
    assert context_line("gpu-a", _client(error=GenerationError("boom"))) is None
