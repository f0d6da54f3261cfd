"""The table of bench/scale.py: each figure's target (issue 14's) at the largest size, the
figures saved per size, and the table of them with the ratios between sizes.
"""

from __future__ import annotations

import itertools
import json

from common import CACHE_DIR, table

RESULTS = CACHE_DIR / "scale-results.json"

# a figure's target at the largest size: (limit, description), limit 0 meaning "the same as
# at the smallest size"
Target = tuple[float, str] | None


def target(name: str) -> Target:
    """Issue 14's target for a figure of the table, by its name."""
    if name.startswith("tokenmill --help, s wall"):
        return (0.3, "< 0.3 s")
    if name.startswith("tokenmill ") and name.endswith(", s wall"):
        return (1.0, "< 1.0 s")
    if name.startswith("metrics: /metrics"):
        return (300.0, "< 300 ms")
    if name.startswith(("claim of", "result write of")) or name.endswith("items/s"):
        return (0.0, "same as the smallest")
    if name.endswith(", ms") and not name.startswith(("events", "parity, every prompt id")):
        return (50.0, "< 50 ms")
    return None


def save(size: int, figures: dict[str, float]) -> None:
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    saved.setdefault(str(size), {}).update(figures)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(saved, indent=1))


def _label(size: int) -> str:
    return f"{size // 1_000_000}M" if size >= 1_000_000 else f"{size // 1000}K"


def report(results: dict[int, dict[str, float]]) -> str:
    sizes = sorted(results)
    names = list(dict.fromkeys(k for s in sizes for k in results[s]))
    headers = ["figure", *(_label(s) for s in sizes)]
    headers += [f"{_label(b)}/{_label(a)}" for a, b in itertools.pairwise(sizes)]
    headers += [f"target at {_label(sizes[-1])}", "met"]
    rows = []
    for name in names:
        values = [results[s].get(name) for s in sizes]
        ratios = [
            f"{b / a:.2f}" if a and b is not None else "—" for a, b in itertools.pairwise(values)
        ]
        goal = target(name)
        verdict = _verdict(goal, values, name_is_rate=name.endswith("items/s"))
        rows.append(
            [
                name,
                *(v if v is not None else "—" for v in values),
                *ratios,
                goal[1] if goal else "",
                verdict,
            ]
        )
    return table(headers, rows)


def _verdict(goal: Target, values: list[float | None], *, name_is_rate: bool) -> str:
    if goal is None or values[-1] is None:
        return ""
    limit, _ = goal
    last = values[-1]
    if limit > 0:
        return "yes" if last < limit else "NO"
    first = values[0]
    if first is None or len(values) < 2:
        return ""
    # "the same": not worse than 1.5 times the smallest ledger's figure (the machine is noisy;
    # a better figure at a larger size is noise, not a cost of the size)
    if name_is_rate:
        return "yes" if last >= first / 1.5 else "NO"
    return "yes" if last <= first * 1.5 else "NO"
