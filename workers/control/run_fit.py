"""Whether a server, as it reports itself now, fits each active run it serves: what the run
pinned (model, weights, limits) against what the server reports, and whether its limits admit
the run's largest request. What `tokenmill restart` prints once the server is back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from app.core.contracts import ServerFingerprint
from app.ledger import registry, run_needs, run_queries
from app.sglang import limits


@dataclass(frozen=True)
class RunFit:
    """One active run against the server: its name, the line that says both sides, and why
    the server does not fit it (None: it fits)."""

    run: str
    line: str
    misfit: str | None


def _shown(fingerprint: dict[str, Any]) -> str:
    """model, weights and limits of a fingerprint, on one line."""
    parts = [
        f"model {fingerprint.get('model_path')}",
        f"weights {fingerprint.get('weight_version')}",
    ]
    parts += [f"{k} {v}" for k, v in (fingerprint.get("limits") or {}).items()]
    return ", ".join(parts)


def run_fits(conn: Connection, server: str, fingerprint: ServerFingerprint) -> list[RunFit]:
    """Each active run the server may serve (a fleet run bound to no servers or to it), with
    what it pinned against what the server reports now."""
    out = []
    now = fingerprint.to_json()
    for run_id, name, pinned in registry.active_run_fingerprints(conn):
        run = run_queries.get_run_by_id(conn, run_id)
        if not (run.fleet_run and run.served_by(server)):
            continue
        differences = ServerFingerprint(**pinned).differences(fingerprint)
        need = run_needs.largest_request(
            conn, run_id, run.generation.sampling.max_new_tokens, pinned.get("limits")
        )
        too_small = None if need is None else limits.refusal(fingerprint.limits, need)
        why = "; ".join(differences) or (
            None
            if too_small is None
            else f"its limits do not admit the largest request: {too_small}"
        )
        verdict = "fits" if why is None else f"does not fit: {why}"
        line = f"run {name}: pinned {_shown(pinned)}; the server now {_shown(now)}: {verdict}"
        out.append(RunFit(name, line, why))
    return out
