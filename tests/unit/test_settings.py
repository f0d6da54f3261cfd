"""Settings that hold wherever they are used: a relative data folder is the one it named when
the settings were read."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.settings import Settings


def test_a_relative_data_dir_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    settings = Settings(data_dir=Path("here/.tokenmill"))
    assert settings.data_dir == tmp_path / "here/.tokenmill"
    assert settings.resolved_storage_url() == (tmp_path / "here/.tokenmill/storage").as_uri()
