"""Every command the docs print is right and run: each line of a ```bash block in README.md,
docs/*.md and ops/README.md is run as printed by a test, or listed with the reason it is not,
and checked here without running it.

Run as printed: the sections in tests/support/readme_fleet.RUN_AS_PRINTED, every command of
them but NOT_RUN's, and the commands of RUN_APART: README's "Distributed", docs/restarts.md,
docs/rendering.md and ops/README's fleet, restart, watch, reconcile, pause, parity, export,
verify, compaction, archive and metrics sections in tests/e2e/test_readme_fleet.py; README's
"One machine", docs/commands.md, docs/drafts.md, docs/weights.md and ops/README's logs, new
weights, the restart with `--command` and the export of one weight version in
tests/e2e/test_guides_as_printed.py; `pip install -e . && tokenmill demo` and the commands the
demo prints in tests/e2e/test_cli.py (`make test` is what CI runs, .ci/run). A command in no
such section fails here until a test runs it or it is listed (NOT_RUN, ALLOWED) with the reason.

Checked here: a `tokenmill ...` command resolves to a command of the CLI (subcommands too) and
its words parse with click (every option exists and takes what it is given; choices and
numbers convert; no argument left over, none required missing), without running it. A
`celery -A app ...` command parses with Celery's own click CLI. `make X` names a target of the
Makefile; `python bench/X.py` a file that exists. `export NAME=...` and `NAME=... command`
assignments of a `TOKENMILL_*` variable name a setting. A command none of these covers must be
in ALLOWED, with the reason.

Relative links between the docs resolve: the file exists and, with a `#fragment`, the file has
a heading of that anchor (GitHub's rule).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from celery.bin.celery import celery as celery_cli

from app.core.settings import Settings
from ops.cli import cli
from tests.support.readme_fleet import ASSIGNMENT, NOT_RUN, RUN_APART, RUN_AS_PRINTED, commands

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "ops" / "README.md"]
LINKED = [*DOCS, ROOT / "emulator" / "README.md", ROOT / "bench" / "README.md"]

# commands neither run as printed nor checkable here, each with the reason
ALLOWED = {
    ("pip", "install", "-e", "."): "installs this checkout; .ci/run installs it the same way "
    "(with the dev extra) on a fresh clone before `make test`",
}


@dataclass(frozen=True)
class Printed:
    """One command of a bash block, where it is printed."""

    doc: str
    line: str
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]
    section: str | None = None  # the `## ` heading it is under, None before the first

    def __str__(self) -> str:
        return f"{self.doc}: {self.line}"


def printed_commands() -> list[Printed]:
    """Every command of every bash block of the docs; `a && b` is two commands."""
    out = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        # a section is a `## ` heading and the text up to the next one
        parts = re.split(r"^## (.*)$", text, flags=re.MULTILINE)
        sections = [(None, parts[0]), *zip(parts[1::2], parts[2::2], strict=True)]
        for heading, body in sections:
            for block in re.findall(r"```bash\n(.*?)```", body, flags=re.DOTALL):
                for command in commands(block):
                    words = list(command.argv)
                    env = tuple(command.env.items())
                    while words:
                        cut = words.index("&&") if "&&" in words else len(words)
                        name = str(doc.relative_to(ROOT))
                        argv = tuple(words[:cut])
                        out.append(Printed(name, command.text, env, argv, heading))
                        words, env = words[cut + 1 :], ()
    return out


PRINTED = printed_commands()


def check_click(group: click.Command, argv: list[str], name: str) -> None:
    """argv parses as a command line of group: each word resolves to a subcommand or parses as
    an option or argument of the command it reaches, without the command running."""
    command, args, path = group, list(argv), [name]
    while True:
        ctx = click.Context(command, info_name=" ".join(path))
        opts, rest, order = command.make_parser(ctx).parse_args(args=list(args))
        check_values(command, ctx, opts, order)
        if not isinstance(command, click.Group):
            assert not rest, f"{' '.join(path)}: unexpected extra arguments {rest}"
            return
        if not rest:
            assert command.invoke_without_command, f"{' '.join(path)} needs a subcommand"
            return
        sub = command.get_command(ctx, rest[0])
        assert sub is not None, f"{' '.join(path)} has no command {rest[0]!r}"
        command, args, path = sub, rest[1:], [*path, rest[0]]


def check_values(
    command: click.Command,
    ctx: click.Context,
    opts: dict[str, object],
    order: list[click.Parameter],
) -> None:
    """The values given convert with each parameter's type (existence of paths aside: the
    printed paths are examples), and no required parameter is missing."""
    for param in command.params:
        if param.name is None or not param.expose_value:
            continue
        value = opts.get(param.name)
        # a missing value: None, or click's UNSET sentinel (click >= 8.2)
        if value is None or repr(value) == "Sentinel.UNSET" or param not in order:
            if param.required and param.envvar is None:
                raise AssertionError(f"{ctx.info_name}: {param.name} is required")
            continue
        if not isinstance(param.type, (click.Path, click.File)):
            param.type_cast_value(ctx, value)


def check_tokenmill(argv: list[str]) -> None:
    check_click(cli, argv[1:], "tokenmill")


def check_celery(argv: list[str]) -> None:
    assert argv[1:3] == ["-A", "app"], "the Celery app is `-A app`"
    check_click(celery_cli, argv[1:], "celery")


def check_make(argv: list[str]) -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w.-]+):", makefile, flags=re.MULTILINE))
    for target in argv[1:]:
        assert target in targets, f"the Makefile has no target {target!r}"


def check_python(argv: list[str]) -> None:
    assert len(argv) > 1 and (ROOT / argv[1]).is_file(), f"no script {argv[1:2]}"


def check_export(argv: list[str]) -> None:
    for word in argv[1:]:
        assert ASSIGNMENT.match(word), f"export of {word!r}: not an assignment"


CHECKS = {
    "tokenmill": check_tokenmill,
    "celery": check_celery,
    "make": check_make,
    "python": check_python,
    "export": check_export,
}
SETTINGS = {f"TOKENMILL_{name.upper()}" for name in Settings.model_fields}


def assigned(printed: Printed) -> list[str]:
    """The variables a command sets: its prefix assignments and what `export` sets."""
    names = [name for name, _ in printed.env]
    if printed.argv[:1] == ("export",):
        names += [word.split("=", 1)[0] for word in printed.argv[1:]]
    return names


@pytest.mark.parametrize("printed", PRINTED, ids=str)
def test_every_printed_command_is_checked(printed: Printed) -> None:
    if printed.argv in ALLOWED:
        return
    check = CHECKS.get(printed.argv[0])
    assert check is not None, f"{printed}: neither checked nor in ALLOWED (with a reason)"
    check(list(printed.argv))
    for name in assigned(printed):
        if name.startswith("TOKENMILL_"):
            assert name in SETTINGS, f"{printed}: {name} is no setting"


def run_by(printed: Printed) -> str | None:
    """The test that runs printed as printed, if one does: the line is in RUN_APART, or its
    section is in RUN_AS_PRINTED and the line is in neither NOT_RUN nor RUN_APART."""
    if (printed.doc, printed.line) in RUN_APART:
        return RUN_APART[(printed.doc, printed.line)]
    if (printed.doc, printed.line) in NOT_RUN:
        return None
    for (doc, heading), test in RUN_AS_PRINTED.items():
        if doc != printed.doc:
            continue
        if heading is None and printed.section is None:
            return test
        if heading is not None and (printed.section or "").startswith(heading):
            return test
    return None


@pytest.mark.parametrize("printed", PRINTED, ids=str)
def test_every_printed_command_is_run_as_printed_or_allowed(printed: Printed) -> None:
    if run_by(printed) or printed.argv in ALLOWED or (printed.doc, printed.line) in NOT_RUN:
        return
    raise AssertionError(
        f"{printed}: no test runs this command as printed. Run it from a test (e2e, real "
        "services, only hosts/ports/paths substituted: see tests/e2e/test_readme_fleet.py) and "
        "add its (doc, section) to RUN_AS_PRINTED in tests/support/readme_fleet.py; or, if it "
        "cannot run in a test, add it to ALLOWED in tests/unit/test_doc_commands.py with the "
        "reason"
    )


# Kimi-K2.5's tokenizer folder is its own code: loading it needs --trust-remote-code
KIMI_FOLDER = re.compile(r"(Kimi-)?K2\.5$")


def test_every_kimi_tokenizer_is_loaded_with_trust_remote_code() -> None:
    kimi = [
        p
        for p in PRINTED
        if p.argv[0] == "tokenmill"
        and "--tokenizer" in p.argv
        and KIMI_FOLDER.search(p.argv[p.argv.index("--tokenizer") + 1])
    ]
    assert kimi, "no printed command loads a Kimi-K2.5 folder"
    missing = [str(p) for p in kimi if "--trust-remote-code" not in p.argv]
    assert not missing, missing


def test_the_allowlist_holds_only_printed_commands() -> None:
    assert set(ALLOWED) <= {p.argv for p in PRINTED}
    lines = {(p.doc, p.line) for p in PRINTED}
    assert set(NOT_RUN) <= lines, set(NOT_RUN) - lines
    assert set(RUN_APART) <= lines, set(RUN_APART) - lines
    assert not set(NOT_RUN) & set(RUN_APART)


def test_a_command_of_no_run_section_is_uncovered() -> None:
    printed = Printed("ops/README.md", "tokenmill x", (), ("tokenmill", "x"), "No such section")
    assert run_by(printed) is None
    printed = Printed(
        "ops/README.md", "tokenmill x", (), ("tokenmill", "x"), "Pause for maintenance"
    )
    assert run_by(printed) == "tests/e2e/test_readme_fleet.py"


def test_a_command_run_apart_is_its_own_tests() -> None:
    (doc, line), test = next(iter(RUN_APART.items()))
    (printed,) = [p for p in PRINTED if (p.doc, p.line) == (doc, line)]
    section_test = run_by(Printed(doc, "tokenmill x", (), ("tokenmill", "x"), printed.section))
    assert run_by(printed) == test != section_test


def test_the_docs_print_commands() -> None:
    docs = {p.doc for p in PRINTED}
    assert {"README.md", "ops/README.md", "docs/restarts.md"} <= docs, docs
    assert sum(p.argv[:1] == ("tokenmill",) for p in PRINTED) > 50


@pytest.mark.parametrize(
    "argv",
    [
        ["tokenmill", "no-such-command"],
        ["tokenmill", "status", "--no-such-option"],
        ["tokenmill", "export", "r1", "--format", "xml", "--out", "r1.xml"],
        ["tokenmill", "servers", "add", "gpu-a:30000"],
        ["tokenmill", "restart", "gpu-a:30000", "--timeout-s", "soon"],
        ["tokenmill", "db"],
        ["tokenmill", "status", "r1", "r2"],
        ["celery", "-A", "app", "worker", "--no-such-option"],
        ["celery", "-A", "app", "wroker"],
        ["make", "no-such-target"],
        ["python", "bench/no_such_bench.py"],
    ],
)
def test_a_wrong_command_fails_its_check(argv: list[str]) -> None:
    with pytest.raises((AssertionError, click.ClickException)):
        CHECKS[argv[0]](argv)


def test_a_misspelt_setting_fails() -> None:
    printed = Printed("x.md", "", (("TOKENMILL_INFLIGTH", "8"),), ("celery", "-A", "app"))
    assert [n for n in assigned(printed) if n not in SETTINGS] == ["TOKENMILL_INFLIGTH"]


# --- links ---------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces
    to `-`."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {anchor(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.MULTILINE)}


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_anchor_is_githubs() -> None:
    heading = "Distributed: Postgres ledger, Redis broker, a worker per GPU node"
    assert anchor(heading) == "distributed-postgres-ledger-redis-broker-a-worker-per-gpu-node"
    assert anchor("Draft evaluation — `tokenmill accept` on two emulated drafts") == (
        "draft-evaluation--tokenmill-accept-on-two-emulated-drafts"
    )


@pytest.mark.parametrize("doc", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    for target in relative_links(doc):
        file, _, fragment = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.exists(), f"{doc.relative_to(ROOT)}: {target} names no file"
        if fragment:
            assert fragment in anchors(path), f"{doc.relative_to(ROOT)}: {target}: no heading"


def test_the_front_page_links_every_guide() -> None:
    readme = ROOT / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in relative_links(readme)}
    assert set((ROOT / "docs").glob("*.md")) <= linked
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= 250
