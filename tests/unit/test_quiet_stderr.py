"""What tokenmill keeps off stderr: transformers' no-PyTorch advice (whoever imports transformers
first) and kombu's "No hostname" line for the folder broker; other warnings still show."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from kombu import Connection

from app.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
NO_TORCH = "PyTorch was not found"


def stderr_of(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_transformers_imported_first_elsewhere_stays_quiet() -> None:
    # the CLI sets logging up before any command runs; transformers is then imported directly,
    # not through load_tokenizer
    err = stderr_of(
        "from ops.options import setup_logging\n"
        "setup_logging('WARNING')\n"
        "import transformers, logging\n"
        "logging.getLogger('transformers').warning('a real transformers warning')\n"
    )
    assert NO_TORCH not in err
    assert "a real transformers warning" in err


def test_the_filter_drops_only_the_no_torch_advice() -> None:
    from app.core.logs import _NoTorchAdvice

    keep = _NoTorchAdvice()

    def passes(message: str) -> bool:
        return keep.filter(logging.LogRecord("transformers", 30, "", 0, message, None, None))

    assert not passes("PyTorch was not found. Models won't be available and only tokenizers ...")
    assert passes("Token indices sequence length is longer than the specified maximum")


def test_the_embedded_broker_names_a_host(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = Settings(data_dir=tmp_path, broker_url=None).resolved_broker_url()
    with caplog.at_level(logging.WARNING, logger="kombu"):
        Connection(url).info()
        Connection("redis://").info()  # a URL without a host: that warning is real, and stays
    hostless = [r for r in caplog.records if "No hostname was supplied" in r.getMessage()]
    assert len(hostless) == 1
