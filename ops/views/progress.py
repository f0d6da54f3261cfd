"""Progress of a long command (`run`, `restart`, `update-weights`, a drain) for a terminal or a
log: on a terminal one frame redrawn in place; in a pipe or a file plain lines, each once.

A command says what it shows as keyed lines, each with a `state`: in a pipe a line is printed
when its key's state changes (so a ticking counter does not print a line per tick), on a
terminal the frame of every line's text is redrawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live


@dataclass(frozen=True)
class Line:
    """One line of progress: `key` names what it is about, `state` what a pipe prints it
    again for (None: its text), `text` what is shown."""

    key: str
    text: str
    state: object = None


class Progress:
    """A redrawn frame on a terminal, lines in a pipe; a context manager around the work."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.terminal = console.is_terminal
        self._live: Live | None = None
        self._printed: dict[str, object] = {}

    def __enter__(self) -> Progress:
        if self.terminal:
            from rich.live import Live

            # the last frame stays on the screen, above what the command prints next
            self._live = Live(console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.__exit__(kind, value, traceback)

    def show(self, lines: Sequence[Line]) -> None:
        """Redraw the frame (terminal) or print the lines whose state changed (pipe)."""
        if self._live is not None:
            from rich.text import Text

            self._live.update(Text("\n".join(line.text for line in lines)))
            return
        for line in lines:
            state = line.text if line.state is None else line.state
            if self._printed.get(line.key, _NEVER) != state:
                self._printed[line.key] = state
                self.say(line.text)

    def say(self, text: str) -> None:
        """A message that stays (above the frame on a terminal), never broken by rich."""
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)


_NEVER = object()
