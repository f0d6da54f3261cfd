"""CPU meters of the benchmarks (a process, Postgres backends, Redis) and py-spy profiles with
their summary.

Imported as `meters` by the scripts in bench/ (the script's folder is first on sys.path).
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import CLK_TCK, redis_cpu_s
from sqlalchemy import Engine, text

# --- CPU meters --------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """user + system CPU seconds of a process (all its threads); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def postgres_backend_pids(db: Engine) -> list[int]:
    """Backends connected to this engine's database (other databases are not counted)."""
    with db.connect() as conn:
        rows = conn.execute(
            text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        ).all()
    return [int(r[0]) for r in rows]


@dataclass
class CpuMeter:
    """CPU seconds used between start() and stop() by named processes, Postgres backends of
    one database (sampled through the run so short-lived ones count too) and Redis."""

    pids: dict[str, int]
    db: Engine | None = None
    redis_url: str | None = None
    _start: dict[str, float] = field(default_factory=dict)
    _pg: dict[int, tuple[float, float]] = field(default_factory=dict)
    _stop_sampling: threading.Event = field(default_factory=threading.Event)
    _sampler: threading.Thread | None = None
    result: dict[str, float] = field(default_factory=dict)

    def _sample_pg(self, *, baseline: bool = False) -> None:
        """Backends seen at start count from their CPU then; later ones from zero (they
        were born during the run)."""
        assert self.db is not None
        for pid in postgres_backend_pids(self.db):
            cpu = proc_cpu_s(pid)
            first = self._pg.get(pid, (cpu if baseline else 0.0, cpu))[0]
            self._pg[pid] = (first, cpu)

    def start(self) -> CpuMeter:
        self._start = {name: proc_cpu_s(pid) for name, pid in self.pids.items()}
        self._start["bench"] = time.process_time()
        if self.redis_url:
            self._start["redis"] = redis_cpu_s(self.redis_url)
        if self.db is not None:
            self._sample_pg(baseline=True)

            def loop() -> None:
                while not self._stop_sampling.wait(1.0):
                    with contextlib.suppress(Exception):
                        self._sample_pg()

            self._sampler = threading.Thread(target=loop, daemon=True)
            self._sampler.start()
        return self

    def stop(self) -> dict[str, float]:
        self.result = {name: proc_cpu_s(pid) - self._start[name] for name, pid in self.pids.items()}
        self.result["bench"] = time.process_time() - self._start["bench"]
        if self.redis_url:
            self.result["redis"] = redis_cpu_s(self.redis_url) - self._start["redis"]
        if self.db is not None:
            self._stop_sampling.set()
            if self._sampler is not None:
                self._sampler.join()
            with contextlib.suppress(Exception):
                self._sample_pg()
            self.result["postgres"] = sum(last - first for first, last in self._pg.values())
        return self.result


# --- profiling with py-spy ---------------------------------------------------------------


def start_profile(pid: int, out: Path, *, duration_s: int, gil: bool = False) -> Any:
    """`py-spy record` of pid into out (collapsed stacks, idle threads left out) in the
    background; gil=True samples only the thread holding the GIL. None if py-spy is absent."""
    import shutil

    exe = shutil.which("py-spy")
    if exe is None:
        print("py-spy is not installed (pip install py-spy); no profile")
        return None
    cmd = [exe, "record", "--pid", str(pid), "--duration", str(duration_s), "--rate", "200"]
    cmd += ["--format", "raw", "--output", str(out), "--nonblocking"]
    if gil:
        cmd.append("--gil")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _frame_name(frame: str) -> str:
    """`func (path/to/file.py:12)` → `func (file.py)`."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({Path(path).name})" if path else name


def profile_summary(raw: Path, top: int = 25, focus: Sequence[str] = ()) -> str:
    """Top functions by self and by inclusive samples from py-spy's collapsed stacks; with
    `focus`, first the inclusive share of the functions whose names contain those."""
    from collections import Counter

    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    if not raw.exists():
        return f"(no profile at {raw})"
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame_name(f) for f in stack.split(";")[1:]]  # [0] is the thread
        if not frames:
            continue
        total += n
        self_c[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    if not total:
        return "(empty profile)"
    lines = [f"{total} samples"]
    if focus:
        lines.append("  incl%   focus")
        for prefix in focus:
            n = max((c for name, c in incl.items() if prefix in name), default=0)
            lines.append(f"  {100 * n / total:5.1f}   {prefix}")
    lines.append("  self%   function")
    for name, n in self_c.most_common(top):
        lines.append(f"  {100 * n / total:5.1f}   {name}")
    lines.append("  incl%   function")
    for name, n in incl.most_common(top + 15):
        lines.append(f"  {100 * n / total:5.1f}   {name}")
    return "\n".join(lines)
