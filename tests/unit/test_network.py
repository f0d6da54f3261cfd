"""The loopback test shared by Flower, /metrics and the emulator."""

from __future__ import annotations

import pytest

from app.core.network import is_loopback


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("", False),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("flower.internal", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
