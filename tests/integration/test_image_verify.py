"""`verify` of image items on real Postgres: clean on a good run; a stored image changed or
removed, a count wrong or missing, and an export's image references broken are each named per
item and image; `tokenmill export --with-images` and `tokenmill verify --export` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, update

from app.core.settings import get_settings
from app.ledger import common
from app.outputs import verify as verify_module
from app.outputs.export import export_run
from app.outputs.verify import (
    CHECK_IMAGE_COUNTS,
    CHECK_IMAGE_STORE,
    CHECK_PROMPT,
    VerifyReport,
    verify_run,
)
from app.prompts.tokenization import load_tokenizer
from ops.cli import cli
from tests.support.image_runs import ImageRun, count_image_reads, make_image_run
from tests.support.procs import clean_env


def verify(db: Engine, built: ImageRun, export: Path | None = None) -> VerifyReport:
    return verify_run(
        db,
        built.run,
        None,
        image_store=built.store,
        export_url=None if export is None else str(export),
    )


def set_item(db: Engine, built: ImageRun, key: str, **values: object) -> None:
    with db.begin() as conn:
        conn.execute(
            update(common.items)
            .where(common.items.c.run_id == built.run.id, common.items.c.item_key == key)
            .values(**values)
        )


def details(report: VerifyReport, check: str) -> list[tuple[str, str]]:
    return [(m.key, m.detail) for m in report.checks[check].examples]


def test_a_good_image_run_is_clean(
    pg_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = make_image_run(pg_engine, tmp_path, "iv-clean")
    read = count_image_reads(verify_module, monkeypatch)
    report = verify(pg_engine, built)
    assert report.clean, report.to_json()
    # four image references ("one" and "two" share an image), each distinct image read once
    assert sorted(read) == sorted(r.sha256 for r in built.refs)
    assert report.checks[CHECK_IMAGE_COUNTS].checked == 3
    assert report.checks[CHECK_IMAGE_STORE].checked == 3
    assert report.checks[CHECK_PROMPT].checked == 4  # served lengths against prompt_tokens


def test_a_changed_or_removed_stored_image_is_named(pg_engine: Engine, tmp_path: Path) -> None:
    built = make_image_run(pg_engine, tmp_path, "iv-store")
    a, b, _ = built.refs
    Path(built.store.path(a.key)).write_bytes(b"changed")
    Path(built.store.path(b.key)).unlink()
    report = verify(pg_engine, built)
    assert not report.clean
    found = dict(details(report, CHECK_IMAGE_STORE))
    assert set(found) == {"one", "two"}  # both use a; b is only in "two"
    assert found["one"].startswith(f"image 0: image {a.key}") and "hashes to" in found["one"]
    assert f"image 1: image {b.key} is missing" in found["two"]


@pytest.mark.parametrize(
    ("counts", "check", "named"),
    [
        ([414, 87], CHECK_PROMPT, "the server reported prompt_tokens"),
        ([414], CHECK_IMAGE_COUNTS, "1 image_token_counts for 2 image(s)"),
        ([414, 0], CHECK_IMAGE_COUNTS, "image_token_counts[1] is 0"),
        (None, CHECK_IMAGE_COUNTS, "2 image(s) and no image_token_counts"),
    ],
)
def test_a_wrong_count_is_named(
    pg_engine: Engine, tmp_path: Path, counts: list[int] | None, check: str, named: str
) -> None:
    built = make_image_run(pg_engine, tmp_path, "iv-count")
    set_item(pg_engine, built, "two", image_token_counts=counts)
    report = verify(pg_engine, built)
    assert not report.clean
    [(key, detail)] = details(report, check)
    assert key == "two" and named in detail


def test_verify_export_checks_a_jsonl_exports_image_references(
    pg_engine: Engine, tmp_path: Path
) -> None:
    built = make_image_run(pg_engine, tmp_path, "iv-export")
    folder = tmp_path / "ds"
    folder.mkdir()
    out = folder / "sf.jsonl"
    export_run(pg_engine, built.run, "specforge", out, image_store=built.store, with_images=True)
    report = verify(pg_engine, built, out)
    assert report.clean, report.to_json()
    assert report.export is not None and report.export.rows == 4
    # a copy removed, and a count in the ledger that no longer matches the export
    c = built.refs[2]
    (folder / c.key).unlink()
    set_item(pg_engine, built, "one", image_token_counts=[413])
    problems = verify(pg_engine, built, out).export.problems  # type: ignore[union-attr]
    assert any("'tool'" in p and f"image 0: {c.key} does not resolve" in p for p in problems)
    assert any(p.startswith("manifest image ") and c.key in p for p in problems)
    assert any(
        "'one'" in p and "image_token_counts [414]; the ledger's [413]" in p for p in problems
    )


def test_verify_export_reads_a_conversations_export_too(
    pg_engine: Engine, tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    built = make_image_run(pg_engine, tmp_path, "iv-conv")
    out = tmp_path / "conv.jsonl"
    tokenizer = load_tokenizer(kimi_tokenizer_dir)
    export_run(
        pg_engine, built.run, "conversations", out, tokenizer=tokenizer, image_store=built.store
    )
    report = verify(pg_engine, built, out)
    assert report.export is not None and report.export.problems == []
    # an image part pointed elsewhere than the row's images list
    lines = out.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    two = next(r for r in rows if r["id"] == "two")
    two["conversations"][0]["content"][2]["image_url"]["url"] = "images/elsewhere.png"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    problems = verify(pg_engine, built, out).export.problems  # type: ignore[union-attr]
    assert any("'two'" in p and "image part 1 does not point at images[1]" in p for p in problems)


def test_the_export_and_verify_commands(
    pg_engine: Engine, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = make_image_run(pg_engine, tmp_path, "iv-cli")
    env = clean_env(
        tmp_path / "data",
        TOKENMILL_DATABASE_URL=pg_url,
        TOKENMILL_STORAGE_URL=(tmp_path / "store").as_uri(),
    )
    for name, value in env.items():
        if name.startswith("TOKENMILL_"):
            monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    runner = CliRunner()
    try:
        out = tmp_path / "pq"
        exported = runner.invoke(
            cli, ["export", "iv-cli", "--format", "parquet", "--out", str(out), "--with-images"]
        )
        assert exported.exit_code == 0, exported.output
        assert "copied 3 images" in exported.output
        manifest = json.loads((out / ".manifest.json").read_text())
        assert len(manifest["images"]) == 3
        clean = runner.invoke(cli, ["verify", "iv-cli", "--export", str(out), "--json"])
        assert clean.exit_code == 1  # the fixture's tokenizer path does not exist: a finding
        data = json.loads(clean.stdout)
        assert data["export"]["problems"] == []
        checks = {c["check"]: c for c in data["checks"]}
        assert checks[CHECK_IMAGE_STORE]["checked"] == 3
        assert checks[CHECK_IMAGE_STORE]["mismatches"] == 0
        folder = tmp_path / "jsonl"
        folder.mkdir()
        sf = folder / "sf.jsonl"
        exported = runner.invoke(cli, ["export", "iv-cli", "--out", str(sf), "--with-images"])
        assert exported.exit_code == 0, exported.output
        assert "copied 3 images" in exported.output
        assert (folder / "sf.jsonl.manifest.json").is_file()
        checked = runner.invoke(cli, ["verify", "iv-cli", "--export", str(sf)])
        assert f"ok   export {sf}: 4 rows" in checked.stdout
        Path(built.store.path(built.refs[0].key)).write_bytes(b"x")
        broken = runner.invoke(cli, ["verify", "iv-cli"])
        assert broken.exit_code == 1
        assert f"image 0: image {built.refs[0].key}" in broken.stdout
    finally:
        get_settings.cache_clear()
