"""The acceptance parts of `tokenmill report` as a person sees them: a run whose results carry
speculative counters gets the acceptance plots, and `report A --compare B` the paired page;
headless Chromium renders both with every image loaded."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.ledger import database, migrate
from tests.support.chromium import CHROMIUM, loaded_images
from tests.support.procs import report_command
from tests.support.spec_runs import make_spec_run

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        CHROMIUM is None, reason="Chromium is not installed (apt-get install -y chromium)"
    ),
]
RUN_IMAGES = ("acceptance_by_group.png", "acceptance_histogram.png", "acceptance_vs_length.png")


def report(url: str, tmp: Path, *args: str) -> str:
    done = report_command(url, tmp, *args)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.fixture(scope="module")
def ledger_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("accept-report")
    url = f"sqlite:///{tmp / 'ledger.sqlite3'}"
    engine = database.make_engine(url)
    migrate.upgrade(engine)
    make_spec_run(engine, "draft-a", seed=1)
    make_spec_run(engine, "draft-b", seed=2, shift=0.08)
    engine.dispose()
    return url


def test_run_page_shows_acceptance(ledger_url: str, tmp_path: Path) -> None:
    out = tmp_path / "a"
    printed = report(ledger_url, tmp_path, "draft-a", "--out", str(out))
    assert "(8 plots, 90 finished items)" in printed
    page = (out / "index.html").read_text()
    srcs = re.findall(r'<img src="([^"]+)"', page)
    assert srcs[-3:] == list(RUN_IMAGES)
    images, dom = loaded_images(out / "index.html", tmp_path)
    assert len(images) == 8 and all(i["loaded"] and i["width"] == 1000 for i in images), images
    assert "Speculative decoding" in dom and "category=code" in dom


def test_compare_page(ledger_url: str, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    report(ledger_url, tmp_path, "draft-a", "--compare", "draft-b", "--out", str(out))
    images, dom = loaded_images(out / "index.html", tmp_path)
    assert [i["src"] for i in images] == [
        "paired_category.png",
        "paired_source.png",
        "paired_output_length.png",
    ]
    assert all(i["loaded"] and i["width"] == 1000 for i in images), images
    assert "Better draft overall: draft-b" in dom
    assert "90 of 90 pairs" not in dom and "0 of 90 pairs differ" in dom  # the same outputs
