"""What a run is for and how its conversations are turned into items: the run's kind
(`RunKind`, stored in runs.kind) and the generation kind's turn mode (`TurnsMode`, the
`--turns` flag). Both are string enums whose values are the stored and CLI forms; code asks a
mode what it means (`chains`, `boundary_samples`) instead of comparing strings.
"""

from __future__ import annotations

from enum import StrEnum


class RunKind(StrEnum):
    """A run's kind; each has a policy (workers/engine/policies.py) that builds the request a
    slot sends and reads the outcome it records."""

    GENERATE = "generate"  # sample the target's answers (every run before runs.kind)


class TurnsMode(StrEnum):
    """`--turns`: which assistant turns of a conversation are regenerated, and how."""

    LAST = "last"  # the final assistant turn only, on the dataset's history
    ALL = "all"  # every assistant turn, chained on the regenerated history
    EACH = "each"  # every assistant turn, each on the dataset's history (boundary samples)

    @property
    def chains(self) -> bool:
        """Later turns wait for the one before them (`--turns all`)."""
        return self is TurnsMode.ALL

    @property
    def boundary_samples(self) -> bool:
        """A conversation is one item per assistant turn, served together (`--turns each`)."""
        return self is TurnsMode.EACH

    @property
    def final_only(self) -> bool:
        """Only the conversation's last assistant turn is regenerated (`--turns last`)."""
        return self is TurnsMode.LAST

    @classmethod
    def parse(cls, value: str, field: str = "turns") -> TurnsMode:
        """The mode named value; an error naming the field and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"{field}: {value!r} is not a turn mode ({choices})") from None
