"""The name this process gives the services it connects to (Postgres' `application_name`), e.g.
`tokenmill-worker gpu-a:30000`, `tokenmill-beat`, `tokenmill status`; set once at its start."""

from __future__ import annotations

# Postgres keeps the first 63 bytes of an application_name
MAX_BYTES = 63

_name = "tokenmill"


def name_process(name: str) -> None:
    """Name this process; connections opened after this carry the name (pg_stat_activity)."""
    global _name
    _name = name.encode()[:MAX_BYTES].decode(errors="ignore")


def process_name() -> str:
    return _name
