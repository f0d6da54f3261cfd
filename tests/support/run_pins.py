"""A worker's RunPins on a fake server (anything with fingerprint() and close()) and a clock
the test moves, for the unit tests of what a run pins."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from workers.engine.run_pins import RunPins


class NoImages:
    """The image checks of runs without images."""

    def pins(self, run_id: int) -> Any:
        return None


def pins_on(db: Engine, server: Any, now: list[float], name: str = "gpu-a") -> RunPins:
    """RunPins of server `name`, reading its fingerprint from server, at the time now[0]."""
    return RunPins(
        db,
        name,
        only_run=None,
        new_client=lambda: server,
        images=NoImages(),  # type: ignore[arg-type]
        on_fingerprint_read=lambda: None,
        on_auth=lambda error: None,
        on_weights_noted=lambda: None,
        clock=lambda: now[0],
    )
