"""The environment as the settings read it: unknown TOKENMILL_* variables named with the
setting they resemble, invalid values named by variable, log levels, broker schemes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.core.broker_url import check_broker_url
from app.core.errors import ConfigurationError
from app.core.settings import Settings, describe_invalid, unknown_env_names


def test_a_misspelt_setting_is_named_with_the_one_it_resembles() -> None:
    lines = unknown_env_names(
        {
            "TOKENMILL_INFLIGTH": "8",
            "TOKENMILL_INFLIGHT": "8",  # a setting
            "TOKENMILL_QQQZZZ": "1",
            "TOKENMILL_EMULATOR_STEP_MS": "1",  # the emulator's flags
            "TOKENMILL_TEST_PG_ADMIN_URL": "x",  # the test suite's services
            "TOKENMILL_BUCKET": "b",  # docker-compose's
            "PATH": "/bin",
        }
    )
    assert lines == [
        "TOKENMILL_INFLIGTH is not a tokenmill setting and is ignored; "
        "did you mean TOKENMILL_INFLIGHT?",
        "TOKENMILL_QQQZZZ is not a tokenmill setting and is ignored",
    ]


def test_an_invalid_value_is_one_line_naming_its_variable() -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(inflight="abc")  # type: ignore[arg-type]
    line = describe_invalid(caught.value)
    assert line.startswith("invalid configuration: TOKENMILL_INFLIGHT: ")
    assert "\n" not in line


def test_log_levels_are_logging_s_own() -> None:
    assert Settings(log_level="warning").log_level == "WARNING"  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="log_level"):
        Settings(log_level="verbose")  # type: ignore[arg-type]


def test_a_broker_scheme_without_transport_is_refused_with_the_close_one() -> None:
    check_broker_url("redis://127.0.0.1:6379/0")
    check_broker_url("filesystem://localhost/")
    with pytest.raises(ConfigurationError) as caught:
        check_broker_url("redsi://user:hunter2@host:6379/0")
    message = str(caught.value)
    assert "TOKENMILL_BROKER_URL" in message and "did you mean redis://?" in message
    assert "hunter2" not in message
