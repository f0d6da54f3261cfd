"""A storage failure that s3fs lets through as botocore's own error (no credentials found) is
one line and exit 2 from every command, not a traceback."""

from __future__ import annotations

import pytest
from botocore.exceptions import NoCredentialsError

from ops.options import handle_errors


def test_missing_storage_credentials_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    @handle_errors
    def command() -> None:
        raise NoCredentialsError()

    with pytest.raises(SystemExit) as stopped:
        command()
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: the object storage failed: Unable to locate credentials")
    assert "TOKENMILL_STORAGE_OPTIONS" in line
