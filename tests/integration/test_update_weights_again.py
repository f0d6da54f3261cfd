"""`tokenmill update-weights` offers its own command to run again only where that command can
work once the cause is fixed (a server down, an update the server refused), never where it
would fail the same way (a checkpoint path missing here, a server that ignores the version)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from app.core.contracts import ServerFingerprint
from app.core.settings import Settings
from app.ledger import registry
from tests.integration.test_watchdog import RecordingControl
from workers.control import weights_update
from workers.control.watchdog import Probe
from workers.control.weights_update import UpdateRequest, update_weights

URL = "http://127.0.0.1:30000"  # loopback: a local --model-path is checked here


class Answering:
    """A prober to which the server answers, or does not."""

    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def probe(self, server: registry.ServerInfo) -> Probe:
        return Probe(self.ok, 0.01, None if self.ok else "Connection refused")

    def fingerprint(self, server: registry.ServerInfo) -> ServerFingerprint:
        return ServerFingerprint()


class IgnoresTheVersion:
    """An SGLang client whose server loads the weights and keeps its weight_version."""

    def update_weights_from_disk(self, model_path: str, **options: Any) -> tuple[bool, str]:
        return True, "Succeeded to update model weights."

    def fingerprint(self) -> ServerFingerprint:
        return ServerFingerprint(model_path="/ckpt", weight_version="default")

    def close(self) -> None:
        pass


@pytest.fixture
def ledger(sqlite_engine: Engine) -> Engine:
    with sqlite_engine.begin() as conn:
        registry.upsert_server(conn, "gpu-x", URL)
    return sqlite_engine


def test_a_server_that_does_not_answer_is_started_then_updated_with_the_same_command(
    ledger: Engine, tmp_path: Path
) -> None:
    request = UpdateRequest("gpu-x", str(tmp_path))
    result = update_weights(
        ledger, Settings(data_dir=tmp_path), RecordingControl(), request, prober=Answering(False)
    )
    assert not result.ok and result.again == request.command()


def test_a_missing_checkpoint_path_is_not_offered_again(ledger: Engine, tmp_path: Path) -> None:
    request = UpdateRequest("gpu-x", str(tmp_path / "ckpt-typo"))
    result = update_weights(
        ledger, Settings(data_dir=tmp_path), RecordingControl(), request, prober=Answering(True)
    )
    assert not result.ok and result.again is None
    assert "does not exist on gpu-x" in result.message and "nothing was paused" in result.message


def test_a_server_that_ignores_the_version_is_not_asked_again(
    ledger: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weights_update, "client_for", lambda url, settings: IgnoresTheVersion())
    request = UpdateRequest("gpu-x", str(tmp_path), weight_version="step-200")
    result = update_weights(
        ledger, Settings(data_dir=tmp_path), RecordingControl(), request, prober=Answering(True)
    )
    assert not result.ok and result.paused and result.again is None
    assert "reports weight_version default, not step-200" in result.message
    assert "`tokenmill resume --server gpu-x`" in result.message
