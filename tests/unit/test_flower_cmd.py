"""`tokenmill flower`: what it runs, that the credentials stay off the command line, and that
it refuses to listen beyond loopback without a password; plus the readable message args."""

from __future__ import annotations

import os
import sys

import pytest
from click.testing import CliRunner

from app.core.errors import ConfigurationError
from app.core.settings import SecretStr, Settings
from ops import flower_cmd as module
from ops.flower_cmd import flower_cmd, flower_launch
from workers.intake.publish import describe


def test_without_password_loopback_only() -> None:
    launch = flower_launch(Settings(), "127.0.0.1", 5555)
    assert launch.argv == [
        sys.executable,
        "-m",
        "ops.flower_app",
        "--address=127.0.0.1",
        "--port=5555",
    ]
    assert launch.env == {} and launch.user is None
    for host in ("0.0.0.0", "", "gpu-a"):
        with pytest.raises(ConfigurationError, match="TOKENMILL_FLOWER_PASSWORD"):
            flower_launch(Settings(), host, 5555)


def test_credentials_go_to_the_environment_not_argv() -> None:
    settings = Settings(flower_user="ops", flower_password=SecretStr("s3cret"))
    launch = flower_launch(settings, "0.0.0.0", 8080)
    assert launch.env == {"FLOWER_BASIC_AUTH": "ops:s3cret"}
    assert launch.user == "ops"
    assert "--address=0.0.0.0" in launch.argv and "--port=8080" in launch.argv
    assert not any("s3cret" in arg for arg in launch.argv)


@pytest.mark.parametrize(("user", "password"), [("a:b", "pw"), ("a,b", "pw"), ("ops", "p,w")])
def test_credentials_flower_cannot_parse_are_refused(user: str, password: str) -> None:
    with pytest.raises(ConfigurationError):
        flower_launch(Settings(flower_user=user, flower_password=SecretStr(password)), "::1", 1)


def test_command_refuses_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, "get_settings", lambda: Settings())
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("must not start Flower"))
    result = CliRunner().invoke(flower_cmd, ["--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert "refusing to serve Flower on 0.0.0.0 without a password" in result.output


def test_command_execs_flower_with_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(
        flower_host="0.0.0.0", flower_port=5600, flower_password=SecretStr("pw-from-settings")
    )
    monkeypatch.setattr(module, "get_settings", lambda: settings)
    put: dict[str, str] = {}
    monkeypatch.setattr(os, "putenv", put.__setitem__)
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append((path, argv)))
    result = CliRunner().invoke(flower_cmd, [])
    assert result.exit_code == 0, result.output
    ((path, argv),) = calls
    assert path == sys.executable
    assert argv[-2:] == ["--address=0.0.0.0", "--port=5600"]
    assert put == {"FLOWER_BASIC_AUTH": "admin:pw-from-settings"}
    assert "basic auth as admin" in result.output
    assert "pw-from-settings" not in result.output


def test_message_args_are_a_summary() -> None:
    assert describe([10, 11, 12, 13]) == "[4 items: 10..13]"
    assert describe([10, 11, 12, 13], "r1") == "run=r1 [4 items: 10..13]"
