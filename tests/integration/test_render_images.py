"""Image rows rendered on a server (a real emulator process): `--render-with` sends each image
part as SGLang takes it (an `image_url` part holding a data URI of the stored bytes) and stores
what local templating stores; `tokenmill parity` re-renders the stored image prompts equal."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from app.core.contracts import SamplingParams
from app.core.errors import PermanentError
from app.core.settings import get_settings
from app.ledger import reads, run_queries
from app.prompts.tokenization import ChatTokenizer
from app.sglang.render import RenderClient, RenderPolicy, RenderRequest
from emulator.config import EmulatorConfig
from tests.support.emulator import EmulatorProcess, running_emulator
from workers.control.parity import check_run
from workers.intake import producer

FAST: dict[str, Any] = {"median_tokens": 8.0, "token_min": 300, "token_max": 400, "step_ms": 1.0}


@pytest.fixture(scope="module")
def server(kimi_tokenizer_dir: Path) -> Iterator[EmulatorProcess]:
    with running_emulator(EmulatorConfig(port=0, tokenizer=str(kimi_tokenizer_dir), **FAST)) as p:
        yield p


@pytest.fixture(scope="module")
def tokenizer(kimi_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return kimi_tokenizer


class Recording:
    """A render client that keeps every request body it forwards."""

    def __init__(self, client: RenderClient) -> None:
        self.client = client
        self.bodies: list[dict[str, Any]] = []

    def render_many(self, requests: Sequence[RenderRequest]) -> list[list[int] | PermanentError]:
        self.bodies += [r.body() for r in requests]
        return self.client.render_many(requests)

    def probe_sha256(self) -> str:
        """The pin of the server's render (its probe requests are not the rows')."""
        return self.client.probe_sha256()


def png(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def image_rows(folder: Path) -> Path:
    (folder / "a.png").write_bytes(png(32, 16, (9, 9, 9)))
    (folder / "b.png").write_bytes(png(16, 32, (90, 9, 9)))
    rows = [
        {
            "id": f"r{i}",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": f"Row {i}: what differs?"},
                        {"type": "image_url", "image_url": {"url": "a.png"}},
                        {"type": "image_url", "image_url": {"url": "b.png"}},
                    ],
                }
            ],
        }
        for i in range(3)
    ]
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def prompts(db: Engine, run: str) -> list[list[int]]:
    with db.connect() as conn:
        info = run_queries.get_run(conn, run)
        return [
            i.prompt_ids for i in reads.stored_prompts(conn, reads.prompt_item_ids(conn, info.id))
        ]


def test_render_with_sends_data_uris_and_parity_is_equal(
    pg_engine: Engine,
    tokenizer: ChatTokenizer,
    server: EmulatorProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENMILL_STORAGE_URL", str(tmp_path / "store"))
    get_settings.cache_clear()
    path = image_rows(tmp_path)
    sampling = SamplingParams(max_new_tokens=16, seed=1)
    local = producer.EnqueueOptions(path, "local", sampling)
    assert producer.enqueue(pg_engine, tokenizer, local, publish=None).inserted == 3
    policy = RenderPolicy(wait_s=5.0, backoff_s=0.1, backoff_max_s=0.5)
    with RenderClient(
        server.url, window=4, connect_timeout_s=2, timeout_s=30, policy=policy
    ) as client:
        recording = Recording(client)
        remote = producer.EnqueueOptions(path, "remote", sampling, render_with=server.url)
        report = producer.enqueue(
            pg_engine,
            tokenizer,
            remote,
            publish=None,
            renderer=recording,  # type: ignore[arg-type]
        )
        assert (report.inserted, report.skipped) == (3, 0)
        assert prompts(pg_engine, "remote") == prompts(pg_engine, "local")
        sent = recording.bodies[0]["messages"][0]["content"]
        expected = (
            "data:image/png;base64," + base64.b64encode((tmp_path / "a.png").read_bytes()).decode()
        )
        assert sent[1] == {"type": "image_url", "image_url": {"url": expected}}

        with pg_engine.connect() as conn:
            run = run_queries.get_run(conn, "local")
        parity = check_run(pg_engine, run, client, server=server.url)
    assert (parity.checked, parity.equal) == (3, 3)
    get_settings.cache_clear()
