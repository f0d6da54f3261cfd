"""Tables that fit a terminal without cutting a value: columns wrap or are left out in the
order each table states, names and URLs are never cut; plain text, no rich (start-up).

`fit` decides, for a width, which columns stay and how wide each is; `render` draws the rows
(status, servers, events); the dashboard asks `fit` which of its columns to keep.
"""

from __future__ import annotations

import shutil
import textwrap
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

GAP = 2  # spaces between columns
RULE = "─"
NOTHING = "—"  # a cell with nothing to say


@dataclass(frozen=True)
class Column:
    """A column: `drop` orders what goes first when the table does not fit (1 first; None:
    never), `wrap` is the narrowest a column of words may be folded to (None: never folded,
    always as wide as its widest value). A header folds at its spaces."""

    header: str
    right: bool = False
    drop: int | None = None
    wrap: int | None = None


@dataclass(frozen=True)
class Fitted:
    """The columns kept (indexes into the table's columns), their widths, and the headers of
    the columns left out, in the order they went."""

    kept: list[int]
    widths: list[int]
    dropped: list[str]

    @property
    def width(self) -> int:
        return sum(self.widths) + GAP * max(0, len(self.widths) - 1)


def terminal_width() -> int:
    """The terminal's width (COLUMNS when set, as for any terminal program), 80 for a pipe."""
    return shutil.get_terminal_size((80, 24)).columns


def _length(value: str) -> int:
    """The width of a value: its longest line (a value may hold several, one under another)."""
    return max(len(line) for line in value.split("\n"))


def _narrowest(column: Column, values: Sequence[str]) -> int:
    header = max((len(w) for w in column.header.split()), default=1)
    if column.wrap is None:
        return max(header, *(_length(v) for v in values)) if values else header
    longest = max((_length(v) for v in values), default=0)
    return max(header, min(column.wrap, longest))


def _natural(column: Column, values: Sequence[str]) -> int:
    if not values:
        return len(column.header)
    return max(len(column.header), *(_length(v) for v in values))


def fit(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> Fitted:
    """The widest table of these columns that fits `width`: each column as wide as its widest
    value, else headers folded, then columns of words folded down to their `wrap`, then
    columns left out in their `drop` order. What is left when nothing more can go is printed
    whole, wider than `width`: a name is never cut. A column with nothing to say in any row
    (every cell `—`) goes before the others."""
    kept = list(range(len(columns)))
    dropped: list[str] = []
    while True:
        values = {i: [row[i] for row in rows] for i in kept}
        natural = [_natural(columns[i], values[i]) for i in kept]
        narrowest = [_narrowest(columns[i], values[i]) for i in kept]
        gaps = GAP * max(0, len(kept) - 1)
        if sum(natural) + gaps <= width:
            return Fitted(kept, natural, dropped)
        if sum(narrowest) + gaps <= width:
            return Fitted(kept, _shrunk(natural, narrowest, width - gaps), dropped)
        droppable = [i for i in kept if columns[i].drop is not None]
        if not droppable:
            return Fitted(kept, narrowest, dropped)
        first = min(droppable, key=lambda i: (_says_something(values[i]), columns[i].drop or 0))
        kept.remove(first)
        dropped.append(columns[first].header)


def _says_something(values: Sequence[str]) -> bool:
    return any(value != NOTHING for value in values)


def _shrunk(natural: list[int], narrowest: list[int], room: int) -> list[int]:
    """Widths between narrowest and natural adding up to room: the widest give way first."""
    widths = list(natural)
    while sum(widths) > room:
        i = max(range(len(widths)), key=lambda k: widths[k] - narrowest[k])
        if widths[i] <= narrowest[i]:
            break
        widths[i] -= 1
    return widths


def _cell_lines(text: str, width: int, column: Column) -> list[str]:
    out: list[str] = []
    for part in text.split("\n"):
        if column.wrap is None or len(part) <= width:
            out.append(part)
        else:
            out += textwrap.wrap(part, width, break_on_hyphens=False) or [""]
    return out


def render(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int | None = None
) -> tuple[list[str], list[str]]:
    """The lines of the table (headers, a rule, the rows) and the headers of the columns it
    left out."""
    fitted = fit(columns, rows, terminal_width() if width is None else width)
    chosen = [columns[i] for i in fitted.kept]

    def line(cells: list[list[str]]) -> list[str]:
        height = max(len(c) for c in cells)
        out = []
        for k in range(height):
            parts = []
            for column, w, cell in zip(chosen, fitted.widths, cells, strict=True):
                text = cell[k] if k < len(cell) else ""
                parts.append(text.rjust(w) if column.right else text.ljust(w))
            out.append((" " * GAP).join(parts).rstrip())
        return out

    headers = [
        textwrap.wrap(c.header, w) if len(c.header) > w else [c.header]
        for c, w in zip(chosen, fitted.widths, strict=True)
    ]
    top = max(len(h) for h in headers)
    # headers sit on their last line, like the values under them
    lines = line([[""] * (top - len(h)) + h for h in headers])
    lines.append((" " * GAP).join(RULE * w for w in fitted.widths))
    for row in rows:
        cells = [
            _cell_lines(row[i], w, columns[i])
            for i, w in zip(fitted.kept, fitted.widths, strict=True)
        ]
        lines += line(cells)
    return lines, fitted.dropped


def left_out_note(dropped: Sequence[str], width: int | None = None) -> str | None:
    """The line that says which columns did not fit, or None."""
    if not dropped:
        return None
    shown = terminal_width() if width is None else width
    return f"(left out at {shown} columns: {', '.join(dropped)}; --json has every field)"


def count_states(states: Iterable[str]) -> str:
    """`250 healthy, 6 down`: how many of each state, the most common first (the summary line
    over a table of many servers)."""
    counts = Counter(states)
    return ", ".join(
        f"{n} {state}" for state, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    )
