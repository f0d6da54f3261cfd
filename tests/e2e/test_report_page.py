"""`report RUN --out DIR` as a person sees it: the command writes the page and its plots, and
headless Chromium renders index.html with every image loaded (and takes a screenshot)."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from matplotlib.image import imread

from app.ledger import common, database, migrate
from tests.support.chromium import CHROMIUM, chromium, loaded_images
from tests.support.procs import report_command
from tests.support.runs import seed_report_run

IMAGES = (
    "output_lengths.png",
    "finish_reasons.png",
    "throughput.png",
    "latency.png",
    "prompt_vs_output.png",
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        CHROMIUM is None, reason="Chromium is not installed (apt-get install -y chromium)"
    ),
]


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of a two-server run with truncations, failures and pauses, written by the
    click command in a real process."""
    tmp = tmp_path_factory.mktemp("report")
    url = f"sqlite:///{tmp / 'ledger.sqlite3'}"
    engine = database.make_engine(url)
    migrate.upgrade(engine)
    with engine.begin() as conn:
        seed_report_run(conn, common.utcnow() - timedelta(hours=2))
    engine.dispose()
    out = tmp / "report"
    done = report_command(url, tmp, "rep", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "index.html (5 plots, 600 finished items)" in done.stderr
    return out


def test_every_image_loads_in_chromium(report_dir: Path, tmp_path: Path) -> None:
    page = (report_dir / "index.html").read_text()
    assert [re.findall(r'<img src="([^"]+)"', page)] == [list(IMAGES)]
    images, dom = loaded_images(report_dir / "index.html", tmp_path)
    assert [i["src"] for i in images] == list(IMAGES)
    assert all(i["loaded"] and i["width"] == 1000 for i in images), images
    assert "Run rep" in dom
    assert "5.7% of samples were truncated at max_new_tokens = 2,048" in dom
    assert "HTTP 400: the prompt is longer than the context length" in dom
    assert "still paused" in dom  # gpu-a's pause at minute 18 was never lifted


def test_screenshot_is_a_rendered_page(report_dir: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    result = chromium(
        tmp_path,
        f"--screenshot={shot}",
        "--window-size=1100,4200",
        "--virtual-time-budget=10000",
        (report_dir / "index.html").as_uri(),
    )
    assert shot.exists(), result.stderr[-2000:]
    pixels = imread(shot)
    assert pixels.shape[:2] == (4200, 1100)
    # a page with text and plots, not a blank or error page: many distinct colours
    assert len({tuple(p) for p in pixels[::7, ::7, :3].reshape(-1, 3).tolist()}) > 200
