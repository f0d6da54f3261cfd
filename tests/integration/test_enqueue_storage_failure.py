"""An enqueue that fails on its storage (an S3 endpoint nobody answers at) leaves no run behind:
the run is not created, so a second enqueue with the storage fixed pins the storage that works;
and `tokenmill delete` of a run whose storage has gone exits 0 once the run left the ledger."""

from __future__ import annotations

import io
import json
from pathlib import Path

from sqlalchemy import Engine

from app.ledger import run_queries
from tests.support.emulator import free_port
from tests.support.moto_s3 import moto_s3
from tests.support.procs import service_env, tokenmill

RUN = "s3run"


def png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (24, 24), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def unreachable() -> dict[str, object]:
    """Storage options of an endpoint nothing listens at, asked once, briefly."""
    return {
        "endpoint_url": f"http://127.0.0.1:{free_port()}",
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
        "skip_instance_cache": True,
    }


def run_names(db: Engine) -> set[str]:
    with db.connect() as conn:
        return {r.name for r in run_queries.list_runs(conn)}


def test_a_failed_enqueue_leaves_no_run_and_a_second_with_the_storage_fixed_works(
    pg_engine: Engine, pg_url: str, redis_url: str, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "cat.png").write_bytes(png())
    rows = tmp_path / "rows.jsonl"
    message = {"role": "user", "content": [{"type": "text", "text": "Cat?"}]}
    message["content"].append({"type": "image_url", "image_url": {"url": "cat.png"}})
    rows.write_text(json.dumps({"id": "cat", "messages": [message]}) + "\n")
    args = ["enqueue", str(rows), "--run", RUN, "--tokenizer", str(kimi_tokenizer_dir)]
    args += ["--image-root", str(tmp_path)]

    def env(options: dict[str, object]) -> dict[str, str]:
        return service_env(
            pg_url,
            redis_url,
            tmp_path / "data",
            TOKENMILL_STORAGE_URL="s3://imgs/store",
            TOKENMILL_STORAGE_OPTIONS=json.dumps(options),
        )

    failed = tokenmill(args, env(unreachable()))
    assert failed.returncode == 2, failed.stderr
    assert f"run {RUN} was not created" in failed.stderr
    assert RUN not in run_names(pg_engine)
    assert tokenmill(["status", RUN], env(unreachable())).returncode != 0

    with moto_s3("imgs") as options:
        fixed = tokenmill([*args, "--json"], env(options))
        assert fixed.returncode == 0, fixed.stderr
        assert json.loads(fixed.stdout)["inserted"] == 1
    assert RUN in run_names(pg_engine)

    # its storage gone with the moto server: the run still leaves the ledger, and that succeeds
    deleted = tokenmill(["delete", RUN, "--force"], env(unreachable()))  # its item is queued
    assert deleted.returncode == 0, deleted.stderr
    assert f"deleted run {RUN}: 1 item and its events" in deleted.stderr
    assert "could not be removed" in deleted.stderr
    assert RUN not in run_names(pg_engine)
    assert tokenmill(["delete", RUN], env(unreachable())).returncode == 2  # no such run now
