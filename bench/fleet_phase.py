"""The measured phases of bench/fleet.py: the cluster's counters before and after a phase (WAL,
commits, rows, CPU, statements, the connections held) and the tables they print as.

Imported as `fleet_phase` by bench/fleet.py and bench/fleet_control.py.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from fleet_cluster import Cluster, WalShare
from sqlalchemy import Engine, text

TOP_STATEMENTS = 6  # of each phase, by WAL bytes
STATEMENT_CHARS = 90


@dataclass
class Snapshot:
    """Counters of the cluster at one instant."""

    lsn: str
    commits: int
    rows: Counter[str]
    cpu_s: float
    at: float


@dataclass
class Phase:
    """What one phase cost: its deltas, its items and payload bytes."""

    name: str
    items: int
    payload: int
    statements: int
    commits: int
    rows: Counter[str]
    cpu_s: float
    wall_s: float
    wal: list[WalShare]
    connections: dict[str, int]
    top: list[tuple[str, int, int]]  # (statement, calls, WAL bytes), most WAL first

    @property
    def wal_bytes(self) -> int:
        return sum(s.record_bytes + s.fpi_bytes for s in self.wal)

    def per_item(self, value: float) -> float:
        return value / max(1, self.items)


def snapshot(cluster: Cluster, db: Engine) -> Snapshot:
    # backends send their table and transaction counts when idle (at most once a second)
    time.sleep(1.2)
    with db.connect() as conn:  # a commit record flushes the WAL up to it: pg_waldump reads it
        conn.execute(text("SELECT txid_current()"))
        conn.commit()
        lsn = str(conn.execute(text("SELECT pg_current_wal_flush_lsn()")).scalar())
        commits = int(
            conn.execute(
                text("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
            ).scalar()
            or 0
        )
        row = conn.execute(
            text(
                "SELECT sum(n_tup_ins), sum(n_tup_upd), sum(n_tup_hot_upd), sum(n_tup_del) "
                "FROM pg_stat_user_tables"
            )
        ).one()
        conn.rollback()
    rows = Counter({k: int(v or 0) for k, v in zip(("ins", "upd", "hot", "del"), row, strict=True)})
    return Snapshot(lsn, commits, rows, cluster.cpu_s(), time.monotonic())


def checkpoint(db: Engine) -> None:
    with db.connect() as conn:
        conn.execute(text("CHECKPOINT"))
        conn.commit()


class ConnectionPeaks:
    """The most connections each application_name held at once (pg_stat_activity, sampled)."""

    def __init__(self, db: Engine) -> None:
        self.db = db
        self.peak: Counter[str] = Counter()
        self.total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        query = text(
            "SELECT application_name, count(*) FROM pg_stat_activity "
            "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() "
            "GROUP BY application_name"
        )
        with self.db.connect() as conn:
            while not self._stop.is_set():
                counts = dict(conn.execute(query).all())
                conn.rollback()
                for name, count in counts.items():
                    self.peak[name] = max(self.peak[name], int(count))
                self.total = max(self.total, sum(int(c) for c in counts.values()))
                self._stop.wait(0.2)

    def __enter__(self) -> ConnectionPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def by_worker(self) -> dict[str, int]:
        workers = [v for k, v in self.peak.items() if k.startswith("tokenmill-worker")]
        return {
            "total": self.total,
            "workers": len(workers),
            "per worker (max)": max(workers, default=0),
        }


def statements(db: Engine) -> tuple[int, list[tuple[str, int, int]]]:
    """Top-level statements the phase ran (the benchmark's own readings left out) and the
    statements (top-level or in a trigger) that wrote the most WAL."""
    with db.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT query, toplevel, calls, wal_bytes FROM pg_stat_statements "
                "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "AND query !~* 'pg_stat|pg_current_wal|txid_current|CHECKPOINT'"
            )
        ).all()
        conn.rollback()
    ran = sum(int(r.calls) for r in rows if r.toplevel)
    top = sorted(rows, key=lambda r: -int(r.wal_bytes))[:TOP_STATEMENTS]
    return ran, [
        (" ".join(r.query.split())[:STATEMENT_CHARS], r.calls, int(r.wal_bytes)) for r in top
    ]


def reset_statements(db: Engine) -> None:
    with db.connect() as conn:
        conn.execute(text("SELECT pg_stat_statements_reset()"))
        conn.commit()


def measure(cluster: Cluster, db: Engine, name: str, run: Callable[[], tuple[int, int]]) -> Phase:
    """Run run() between two snapshots; run returns (items, payload bytes)."""
    checkpoint(db)
    before = snapshot(cluster, db)
    reset_statements(db)
    with ConnectionPeaks(db) as peaks:
        started = time.monotonic()
        items, payload = run()
        wall_s = time.monotonic() - started
    after = snapshot(cluster, db)
    ran, top = statements(db)
    return Phase(
        name=name,
        items=items,
        payload=payload,
        statements=ran,
        commits=after.commits - before.commits,
        rows=after.rows - before.rows,
        cpu_s=after.cpu_s - before.cpu_s,
        wall_s=wall_s,
        wal=cluster.wal_stats(before.lsn, after.lsn),
        connections=peaks.by_worker(),
        top=top,
    )


def item_total(enqueue: Phase, work: Phase, revision: str) -> Phase:
    """An item's whole cost: its enqueue and its work, per item of the run."""
    return Phase(
        name=f"enqueue + work ({revision})",
        items=work.items,
        payload=enqueue.payload + work.payload,
        statements=enqueue.statements + work.statements,
        commits=enqueue.commits + work.commits,
        rows=enqueue.rows + work.rows,
        cpu_s=enqueue.cpu_s + work.cpu_s,
        wall_s=enqueue.wall_s + work.wall_s,
        wal=[*enqueue.wal, *work.wal],
        connections=work.connections,
        top=[],
    )


# record kinds by what they are: the items' and counters' rows, index entries, commits
WAL_GROUPS = (
    ("heap rows", ("Heap/INSERT", "Heap/UPDATE", "Heap/HOT_UPDATE", "Heap2/MULTI_INSERT")),
    ("row locks, pruning", ("Heap/LOCK", "Heap2/PRUNE", "Heap2/VACUUM", "Heap2/VISIBLE")),
    ("index entries", ("Btree/",)),
    ("commits", ("Transaction/",)),
)


def wal_breakdown(phase: Phase) -> list[tuple[str, float]]:
    """Bytes per item of each record group, full-page images apart."""
    groups: Counter[str] = Counter()
    for share in phase.wal:
        group = next(
            (g for g, kinds in WAL_GROUPS if any(share.kind.startswith(k) for k in kinds)),
            "other",
        )
        groups[group] += share.record_bytes
        groups["full-page images"] += share.fpi_bytes
    return [(g, phase.per_item(b)) for g, b in groups.most_common()]


def row_of(phase: Phase) -> list[str]:
    rows = phase.rows
    written = rows["ins"] + rows["upd"] + rows["del"]
    hot = 100.0 * rows["hot"] / rows["upd"] if rows["upd"] else 0.0
    overhead = phase.wal_bytes - phase.payload
    return [
        phase.name,
        f"{phase.items:,}",
        f"{phase.per_item(phase.commits):.3f}",
        f"{phase.per_item(phase.statements):.3f}",
        f"{phase.per_item(phase.wal_bytes):,.0f}",
        f"{phase.per_item(phase.payload):,.0f}",
        f"{phase.per_item(overhead):,.0f}",
        f"{overhead / phase.payload:.2f}" if phase.payload else "—",
        f"{phase.per_item(written):.2f} ({hot:.0f}% HOT)",
        f"{1000 * phase.per_item(phase.cpu_s):.3f}",
        f"{phase.items / phase.wall_s:,.0f}",
        f"{phase.connections['per worker (max)']} / {phase.connections['total']}",
    ]


HEADERS = [
    "phase",
    "items",
    "commits/item",
    "statements/item",
    "WAL B/item",
    "payload B/item",
    "overhead B/item",
    "overhead/payload",
    "rows written/item",
    "PG CPU ms/item",
    "items/s",
    "conns per worker / all",
]


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
