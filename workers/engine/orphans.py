"""Leases a dead `tokenmill run` left behind: a rerun of the same run on the same host takes
them back at once instead of waiting out the lease (`TOKENMILL_LEASE_S`, 300 s).

Only owners the embedded runner made (`<host>:<pid>:run/<server>:<nonce>`) on this host are
looked at, and only when their process is gone: a live process, or any worker elsewhere,
keeps its leases.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field

from sqlalchemy import Engine

from app.ledger import claims, outcomes

log = logging.getLogger(__name__)

# the label prefix of the embedded runner's lease owners (workers.engine.runtime.make_owner)
EMBEDDED_OWNER_PREFIX = "run/"


@dataclass
class TakenBack:
    """Items released from leases of dead predecessors, and those processes' ids."""

    items: int = 0
    pids: list[int] = field(default_factory=list)


def embedded_owner_pid(owner: str) -> int | None:
    """The process id of an embedded runner's lease owner on this host, else None."""
    host, _, rest = owner.partition(":")
    pid, _, label = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    return int(pid) if label.startswith(EMBEDDED_OWNER_PREFIX) else None


def process_gone(pid: int) -> bool:
    """True when no process has this id (one owned by another user still exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def take_back(db: Engine, run_id: int) -> TakenBack:
    """Release every lease of the run held by an embedded runner of this host that is no
    longer running (and its hedge marks); the items are claimable again at once, with no
    attempt spent."""
    taken = TakenBack()
    with db.connect() as conn:
        owners = claims.lease_owners(conn, run_id)
    for owner in owners:
        pid = embedded_owner_pid(owner)
        if pid is None or pid == os.getpid() or not process_gone(pid):
            continue
        with db.begin() as conn:
            released = outcomes.release_owner(conn, owner)
            claims.drop_hedge_marks(conn, run_id, owner)
        if released:
            taken.items += len(released)
            taken.pids.append(pid)
            log.info(
                "took back %d items leased by %s (process gone)",
                len(released),
                owner,
                extra={"action": "orphans_taken_back"},
            )
    return taken
