"""Tables fitted to a terminal (ops.views.text_table): nothing is cut, headers and word columns
fold, columns go in their stated order, and a table that cannot fit is printed whole."""

from __future__ import annotations

from ops.views.text_table import Column, fit, left_out_note, render

NAME = "localhost:30000-gpu-node-a"
URL = "http://gpu-node-a.cluster.example:30000"
COLUMNS = [
    Column("name"),
    Column("url"),
    Column("in flight", right=True, drop=2),
    Column("last probe", drop=1),
    Column("last error", drop=3, wrap=10),
]
ROW = [NAME, URL, "12", "3s ago ok", "Connection refused by the server at " + URL]


def test_a_table_that_fits_is_left_as_it_is() -> None:
    lines, dropped = render(COLUMNS, [ROW], width=400)
    assert dropped == [] and len(lines) == 3
    assert lines[0].split() == ["name", "url", "in", "flight", "last", "probe", "last", "error"]
    assert lines[2].startswith(f"{NAME}  {URL}")


def test_word_columns_fold_and_columns_go_in_their_order() -> None:
    for width, dropped in ((140, []), (90, ["last probe"]), (80, ["last probe", "in flight"])):
        lines, left_out = render(COLUMNS, [ROW], width=width)
        assert left_out == dropped, width
        assert all(len(line) <= width for line in lines), (width, lines)
        body = " ".join(" ".join(lines[2:]).split())
        assert NAME in body and URL in body, "a name or URL was cut"
        assert "Connection refused" in body  # folded, not cut
    assert left_out_note(["last probe"], 80) == (
        "(left out at 80 columns: last probe; --json has every field)"
    )
    assert left_out_note([], 80) is None


def test_a_column_with_nothing_to_say_goes_before_the_others() -> None:
    quiet = [*ROW[:4], "—"]  # no server has an error: that column says nothing
    assert fit(COLUMNS, [quiet], 90).dropped == ["last error"]
    assert fit(COLUMNS, [quiet, ROW], 90).dropped == ["last probe"]  # one row says something


def test_what_cannot_fit_is_printed_whole_never_cut() -> None:
    fitted = fit(COLUMNS, [ROW], 40)
    assert fitted.dropped == ["last probe", "in flight", "last error"]
    lines, _ = render(COLUMNS, [ROW], width=40)
    assert lines[2] == f"{NAME}  {URL}"
    assert fitted.width == len(NAME) + 2 + len(URL) > 40


def test_numbers_align_right_and_headers_sit_on_their_last_line() -> None:
    lines, _ = render([Column("run"), Column("out tokens", right=True)], [["r1", "7"]], width=11)
    assert lines == ["        out", "run  tokens", "───  ──────", "r1        7"]
