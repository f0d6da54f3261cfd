"""`tokenmill --help` of every command: every option says what it does, and an option's
variable and default are spelled one way, click's `[env var: TOKENMILL_X; default: V]`, never
in the prose; a setting's default as --help prints it is the setting's default."""

from __future__ import annotations

import re
from collections.abc import Iterator

import click
import pytest

from app.core.settings import Settings
from ops.cli import cli
from ops.options import SettingOption

# what an option's help must not say in its own words: the bracket says it
PROSE = {
    "an env var": re.compile(r"\benv\b"),
    "a variable in parentheses": re.compile(r"\(TOKENMILL_\w+[,)]"),
    "a default": re.compile(r"\bdefault:|\bdefault \d|\(default\b", re.IGNORECASE),
}


def commands(command: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        ctx = click.Context(command, info_name=command.name)
        for name in command.list_commands(ctx):  # the lazy group loads each as it is asked
            sub = command.get_command(ctx, name)
            assert sub is not None, name
            yield from commands(sub, f"{path} {name}")


def options() -> list[object]:
    return [
        pytest.param(command, option, id=f"{path} {option.opts[0]}")
        for path, command in commands(cli, "tokenmill")
        for option in command.params
        if isinstance(option, click.Option) and option.name != "help"
    ]


def help_of(command: click.Command, option: click.Option) -> str:
    record = option.get_help_record(click.Context(command, info_name=command.name))
    assert record is not None
    return record[1]


@pytest.mark.parametrize(("command", "option"), options())
def test_every_option_says_what_it_does_one_way(
    command: click.Command, option: click.Option
) -> None:
    text = option.help or ""
    assert text.strip(), "an option without help text"
    for what, pattern in PROSE.items():
        assert not pattern.search(text), f"its help spells {what} in prose: {text!r}"
    shown = help_of(command, option)
    if option.envvar:
        assert option.show_envvar, "reads a variable --help does not name"
        assert f"env var: {option.envvar}" in shown
    unset = (None, getattr(click.core, "UNSET", None))  # click 8.2+: UNSET, not None
    if not option.is_flag and option.default not in unset and not option.required:
        assert option.show_default, f"its default {option.default!r} is not shown"
        assert "default: " in shown


@pytest.mark.parametrize(
    ("command", "option"),
    [p for p in options() if isinstance(p.values[1], SettingOption)],  # type: ignore[attr-defined]
)
def test_a_settings_default_is_the_one_help_shows(
    command: click.Command, option: SettingOption
) -> None:
    field = Settings.model_fields[option.setting.removeprefix("TOKENMILL_").lower()]
    default = field.default
    assert option.shown_default == str(int(default) if isinstance(default, float) else default)
    assert f"[env var: {option.setting}; default: {option.shown_default}" in help_of(
        command, option
    )


def test_the_walk_sees_every_command() -> None:
    paths = {path for path, _ in commands(cli, "tokenmill")}
    assert {"tokenmill status", "tokenmill servers add", "tokenmill emulator"} <= paths
    assert len(options()) > 60
