"""The CLI's lines as an operator reads them: counts in the number their noun takes, and
nothing waited for that is not there."""

from __future__ import annotations

from ops.options import counted
from ops.run_cmd import CONTINUE, interrupted_line


def test_a_count_takes_its_noun_in_the_right_number() -> None:
    assert counted(1, "row") == "1 row"
    assert counted(0, "row") == "0 rows"
    assert counted(2, "Parquet shard") == "2 Parquet shards"
    assert counted(1, "Parquet shard") == "1 Parquet shard"
    assert counted(3, "child", "children") == "3 children"


def test_an_interrupt_with_nothing_in_flight_waits_for_nothing() -> None:
    assert interrupted_line(0, 30) == f"interrupted: nothing in flight, stopping. {CONTINUE}"
    one = interrupted_line(1, 30)
    assert one.startswith("interrupted: waiting up to 30s for the 1 request in flight to finish")
    assert "the 7 requests in flight" in interrupted_line(7, 30)


def test_click_s_usage_errors_take_the_house_wording() -> None:
    """`error: …` as every other error line, with click's usage and hint lines kept."""
    from click.testing import CliRunner

    from ops.cli import cli

    for args, message in (
        (["status", "--bogus"], "error: No such option '--bogus'."),
        (["statuss"], "error: No such command 'statuss'."),
        (["db", "upgradee"], "error: No such command 'upgradee'."),
        (["export", "r1", "--format", "x", "--out", "y"], "error: Invalid value for '--format'"),
    ):
        result = CliRunner().invoke(cli, args, prog_name="tokenmill")
        assert result.exit_code == 2, result.output
        assert message in result.stderr and "Error:" not in result.stderr, result.stderr
        assert result.stderr.startswith("Usage: tokenmill"), result.stderr
