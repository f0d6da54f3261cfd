"""Headless Chromium for the report pages' tests: the binary, a run of it with a private
profile, and a script that records whether each image of a page decoded."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
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


def loaded_images(page: Path, tmp_path: Path) -> tuple[list[dict[str, Any]], str]:
    """Render `page` (a copy beside it, with IMAGE_CHECK): each image's src, whether it decoded
    and its width, and the rendered DOM."""
    check = page.with_name("image-check.html")  # same folder: same relative image paths
    check.write_text(page.read_text().replace("</body>", IMAGE_CHECK + "</body>"))
    result = chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", check.as_uri())
    check.unlink()
    found = re.search(r'<pre id="image-check">(.*?)</pre>', result.stdout, re.S)
    assert found, result.stderr[-2000:]
    images: list[dict[str, Any]] = json.loads(found.group(1).replace("&quot;", '"'))
    return images, result.stdout
