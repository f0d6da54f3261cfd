"""SGLang's --api-key, emulated and honoured: routes need the bearer key except health and
readiness probes, the client sends TOKENMILL_SGLANG_API_KEY, a wrong key makes items wait
(never fail), and the emulator refuses to listen beyond loopback without a key."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from app.core.errors import ServerUnavailable
from app.core.settings import Settings
from app.sglang.client import client_for
from emulator.config import EmulatorConfig
from tests.support.emulator import running_emulator

KEY = "k3y-for-tests"
SAMPLING = {"max_new_tokens": 8, "temperature": 0.0}


def test_routes_need_the_key_and_health_probes_do_not() -> None:
    with running_emulator(EmulatorConfig(api_key=KEY, step_ms=0)) as emu:
        url = emu.url
        body = {"input_ids": [1, 2, 3], "sampling_params": SAMPLING}
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/health_generate").status_code == 200
        assert httpx.get(f"{url}/ready").status_code == 200  # as SGLang's utils/auth.py
        refused = httpx.post(f"{url}/generate", json=body)
        assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
        wrong = httpx.post(f"{url}/generate", json=body, headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401
        assert httpx.get(f"{url}/model_info").status_code == 401
        ok = httpx.post(f"{url}/generate", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) > 0
        info = httpx.get(f"{url}/server_info", headers={"Authorization": f"Bearer {KEY}"})
        assert info.status_code == 200 and KEY not in info.text


def test_the_worker_client_sends_the_configured_key() -> None:
    with running_emulator(EmulatorConfig(api_key=KEY, step_ms=0)) as emu:
        keyed = Settings(sglang_api_key=KEY)
        with client_for(emu.url, keyed) as client:
            assert client.generate([5, 6, 7], SAMPLING, "rid-1").output_ids
            assert client.fingerprint().version
        assert KEY not in repr(keyed) and KEY not in str(keyed.model_dump())
        # the deployment's fault, not the item's: ServerUnavailable spends no attempt
        with (
            client_for(emu.url, Settings()) as anonymous,
            pytest.raises(ServerUnavailable, match="TOKENMILL_SGLANG_API_KEY"),
        ):
            anonymous.generate([5, 6, 7], SAMPLING, "rid-2")


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_the_emulator_refuses_to_listen_beyond_loopback_without_a_key(host: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "emulator", "--host", host, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "without an API key" in result.stderr and "--api-key" in result.stderr


def test_the_watchdog_reports_a_refused_key_as_auth_not_healthy() -> None:
    from app.ledger import registry
    from workers.control.watchdog import HttpProber

    with running_emulator(EmulatorConfig(api_key=KEY, step_ms=0)) as emu:
        server = registry.ServerInfo(
            name="gpu-k", url=emu.url, state="healthy", state_since=None, paused=False,
            paused_by=None, pause_reason=None, consecutive_failures=0, consecutive_successes=0,
            last_probe_at=None, last_probe_ok=None, last_probe_latency_s=None, last_error=None,
            fingerprint=None, restart_command=None, workers=[],
        )  # fmt: skip
        refused = HttpProber(Settings(sglang_api_key="wrong")).probe(server)
        assert not refused.ok and refused.auth
        assert refused.error is not None and "HTTP 401" in refused.error
        assert "TOKENMILL_SGLANG_API_KEY" in refused.error
        assert HttpProber(Settings(sglang_api_key=KEY)).probe(server).ok
