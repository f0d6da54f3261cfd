"""The `parity` command: a server re-renders a run's stored prompts through its /v1/tokenize.

Exit 0 when every checked prompt is equal, 1 when any differs, 2 on usage/configuration errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from app.core.errors import ConfigurationError
from ops.options import get_settings, handle_errors, open_db, print_json

if TYPE_CHECKING:
    from rich.console import Console

    from workers.control.parity import Mismatch, ParityReport

# the server's outage is waited out this long before the command gives up (exit 2)
PARITY_WAIT_S = 30.0
MISMATCHES_SHOWN = 20


@click.command("parity")
@click.argument("run_name")
@click.option(
    "--server",
    "server",
    required=True,
    metavar="NAME|URL",
    help="A registered server's name, or a server URL.",
)
@click.option(
    "--sample",
    type=click.IntRange(min=1),
    default=None,
    show_default="every prompt",
    help="Check this many prompts drawn with --seed.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the --sample draw.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@handle_errors
def parity_cmd(run_name: str, server: str, sample: int | None, seed: int, as_json: bool) -> None:
    """Re-render RUN_NAME's stored prompts on a server and compare them with the stored ids.

    Each prompt is rebuilt by the server's /v1/tokenize from the item's stored messages and
    the run's template kwargs, as a chat completion would render it. Run it before a long run
    to see that the server builds the prompts tokenmill built. The report names the client's
    and the server's versions (transformers, SGLang). Only a real SGLang server is proof: the
    emulator renders with tokenmill's own code.
    """
    from app.ledger import registry, run_queries
    from app.sglang.render import render_client
    from workers.control.parity import check_run

    settings = get_settings()
    db = open_db(settings)
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
        if server.startswith(("http://", "https://")):
            name, url = server.rstrip("/"), server.rstrip("/")
        else:
            name, url = server, registry.get_server(conn, server).url
    if not url:
        raise ConfigurationError(f"--server {server!r} has no URL")
    with render_client(url, settings, wait_s=PARITY_WAIT_S) as client:
        report = check_run(db, run, client, server=name, sample=sample, seed=seed)
    if as_json:
        print_json(report.to_json())
    else:
        _print(report)
    raise SystemExit(0 if not report.mismatches else 1)


def _out() -> Console:
    """The report is the command's output: stdout (errors go to stderr via handle_errors)."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def _print(report: ParityReport) -> None:
    from rich.markup import escape

    out = _out()
    out.print(
        f"run {escape(report.run)} on {escape(report.server)}: {report.checked} checked, "
        f"{report.equal} equal, {report.mismatched} mismatched"
    )
    v = report.versions
    out.print(
        f"client: transformers {v.get('client_transformers')} (the run's prompts rendered with "
        f"{v.get('run_transformers') or 'the server'}, as {v.get('run_renders_as') or 'the server'}"
        f"); server: SGLang {v.get('server_sglang') or 'unknown'} (transformers "
        f"{v.get('server_transformers') or 'unknown to tokenmill'})"
    )
    for mismatch in report.mismatches[:MISMATCHES_SHOWN]:
        _print_mismatch(mismatch)
    if report.mismatched > MISMATCHES_SHOWN:
        out.print(f"… {report.mismatched - MISMATCHES_SHOWN} more (--json lists them all)")


def _print_mismatch(m: Mismatch) -> None:
    from rich.markup import escape

    out = _out()
    where = f"item {m.item_id} (key {m.item_key!r}, sample {m.sample_index}, turn {m.turn_index})"
    if m.position is None:
        out.print(f"\n{escape(where)}: the server refused it: {escape(m.error or '')}")
        return
    out.print(
        f"\n{escape(where)}: first difference at token {m.position} "
        f"(stored {m.stored_tokens} tokens, server {m.server_tokens})"
    )
    out.print(f"  before  …{escape(repr(m.before))}")
    out.print(f"  stored  {escape(repr(m.stored))}…  ids {m.stored_ids}")
    out.print(f"  server  {escape(repr(m.server))}…  ids {m.server_ids}")
