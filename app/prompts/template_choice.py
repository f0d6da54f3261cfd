"""Which chat template a run renders with: the one SGLang 0.5.23's TemplateManager picks.

A tokenizer with several named templates (`[{"name": "default", ...}, {"name": "tool_use", ...}]`)
renders its first one, unless the run names one (`--chat-template-name`, as the server's
`--hf-chat-template-name`). A run with `--chat-template FILE` (for a server started with
`--chat-template FILE`) renders that file, read as SGLang reads a `.jinja` file: its lines
joined, newlines stripped from both ends, and each literal backslash-n turned into a newline;
the content format is detected from the text before that last step, as SGLang does.

A folder with no chat template at all (DeepSeek-V3.2, whose server renders with its Python
encoder) loads only for a run the server renders (`--render-with`): its template is
`ChosenTemplate.server_rendered()`, which nothing renders locally.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.errors import TokenizerError


@dataclass(frozen=True)
class TemplateChoice:
    """What the run says about its template (both None: the tokenizer's, first if named)."""

    name: str | None = None
    file: str | None = None

    def __post_init__(self) -> None:
        if self.name is not None and self.file is not None:
            raise TokenizerError(
                "--chat-template-name picks one of the tokenizer's named templates and "
                "--chat-template replaces them; give one of the two"
            )


@dataclass(frozen=True)
class ChosenTemplate:
    """The template text rendered with, the text its content format is detected from, and
    what the run pins (the name, or the file and its sha256)."""

    text: str
    detect_from: str
    name: str | None = None
    file: str | None = None
    file_hash: str | None = None
    # no local template: the run's server renders every prompt (`--render-with`)
    on_server: bool = False

    @classmethod
    def server_rendered(cls) -> ChosenTemplate:
        """The template of a folder that has none, for a run the server renders."""
        return cls("", "", on_server=True)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def choose_template(
    template: Any, choice: TemplateChoice, folder: Path, *, server_renders: bool = False
) -> ChosenTemplate:
    """The template SGLang renders with, from the tokenizer's chat_template (a string, or a
    dict of named ones in their file order) and the run's choice; TokenizerError naming why
    none can be chosen. server_renders: the run's server renders (`--render-with`), so a
    folder without a template is no error."""
    if choice.file is not None:
        return _from_file(Path(choice.file))
    if isinstance(template, dict):
        names = list(template)
        if not names:
            raise TokenizerError(f"the tokenizer in {str(folder)!r} has an empty list of templates")
        name = choice.name if choice.name is not None else names[0]
        if name not in template:
            raise TokenizerError(
                f"--chat-template-name {name!r} is not one of the tokenizer's templates "
                f"({', '.join(names)})"
            )
        text = template[name]
        return ChosenTemplate(text, text, name=name)
    if choice.name is not None:
        raise TokenizerError(
            f"--chat-template-name {choice.name!r}: the tokenizer in {str(folder)!r} has one "
            "template, not named ones"
        )
    if not isinstance(template, str) or not template:
        if server_renders:
            return ChosenTemplate.server_rendered()
        raise TokenizerError(
            f"the tokenizer in {str(folder)!r} has no chat template "
            "(no chat_template in tokenizer_config.json and no chat_template.jinja): render "
            "with the server (--render-with URL), as SGLang renders such a model with its own "
            "encoder, or give one with --chat-template FILE"
        )
    return ChosenTemplate(template, template)


def _from_file(path: Path) -> ChosenTemplate:
    path = path.expanduser()
    if path.suffix != ".jinja":
        # SGLang reads any other file as a JSON conversation template, which is not Jinja
        raise TokenizerError(
            f"--chat-template {str(path)!r}: tokenmill renders .jinja templates; SGLang reads "
            "another file as a conversation template of its own (use --render-with for that)"
        )
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read the chat template {str(path)!r}: {exc}") from exc
    stripped = raw.strip("\n")
    data = raw.encode("utf-8")
    return ChosenTemplate(
        stripped.replace("\\n", "\n"),
        stripped,
        file=str(path.resolve()),
        file_hash=hashlib.sha256(data).hexdigest(),
    )
