"""`report RUN --out DIR` as a person sees it: the command writes the page and its plots, and
headless Chromium renders index.html with every image loaded (and takes a screenshot)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from matplotlib.image import imread

from app import ledger
from app.ledger.database import make_engine
from app.ledger.migrate import upgrade
from tests.support.procs import ROOT, clean_env
from tests.support.runs import seed_report_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
IMAGES = (
    "output_lengths.png",
    "finish_reasons.png",
    "throughput.png",
    "latency.png",
    "prompt_vs_output.png",
)
# appended to a copy of the page: records, once everything loaded, whether each image decoded
IMAGE_CHECK = """<script>
window.addEventListener("load", () => {
  const found = Array.from(document.images).map((img) => ({
    src: img.getAttribute("src"), loaded: img.complete && img.naturalWidth > 0,
    width: img.naturalWidth }));
  const out = document.createElement("pre");
  out.id = "image-check";
  out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
});
</script>"""

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        CHROMIUM is None, reason="Chromium is not installed (apt-get install -y chromium)"
    ),
]


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'chromium-profile'}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of a two-server run with truncations, failures and pauses, written by the
    click command in a real process."""
    tmp = tmp_path_factory.mktemp("report")
    url = f"sqlite:///{tmp / 'ledger.sqlite3'}"
    engine = make_engine(url)
    upgrade(engine)
    with engine.begin() as conn:
        seed_report_run(conn, ledger.utcnow() - timedelta(hours=2))
    engine.dispose()
    out = tmp / "report"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ops.report import report_cmd; report_cmd()",
            "rep",
            "--out",
            str(out),
        ],
        env=clean_env(tmp / "data", TOKENMILL_DATABASE_URL=url),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "index.html (5 plots, 600 finished items)" in done.stderr
    return out


def test_every_image_loads_in_chromium(report_dir: Path, tmp_path: Path) -> None:
    page = (report_dir / "index.html").read_text()
    assert [re.findall(r'<img src="([^"]+)"', page)] == [list(IMAGES)]
    check = report_dir / "image-check.html"  # beside index.html: same relative image paths
    check.write_text(page.replace("</body>", IMAGE_CHECK + "</body>"))
    result = chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", check.as_uri())
    check.unlink()
    found = re.search(r'<pre id="image-check">(.*?)</pre>', result.stdout, re.S)
    assert found, result.stderr[-2000:]
    images = json.loads(found.group(1).replace("&quot;", '"'))
    assert [i["src"] for i in images] == list(IMAGES)
    assert all(i["loaded"] and i["width"] == 1000 for i in images), images
    dom = result.stdout
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
