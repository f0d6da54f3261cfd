"""Images: multimodal rows enqueued into the image store, and what an image costs a generation.

enqueue   N rows (one image each mostly, some two or three) over D distinct images of
          256–2048 px a side (JPEG and PNG, Zipf-like reuse: a few images in many rows,
          most in one or two), written next to the rows file and referenced by relative
          path, then `workers.intake.producer.enqueue(..., publish=None)` into a fresh
          Postgres database with the store in a local folder: rows/s, bytes stored, and how
          many times each image file was opened (a `sys.addaudithook` "open" hook counts
          every open of a file under the image folder, whoever opens it: each distinct
          image must be read once);
generate  one emulator in `--mm kimi` mode answering at once (`--step-ms 0`, fixed outputs),
          the embedded runner (`tokenmill run`'s) over M image items (one image each,
          from the store) and over M text items of exactly the same served prompt lengths
          (pre-tokenized ids), image and text runs alternating twice: wall ms per item of
          each, and their ratio.

  python bench/images.py                       # 10,000 rows over 2,500 images; 400 items
  python bench/images.py --rows 2000 --distinct 500 --items 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from common import bench_database, emulator, engine_for, fixture_tokenizer_dir, machine_note, table

# the emulated vision encoder costs nothing: what is left is what images cost tokenmill and
# the server's image loading (decode, count), not GPU time
EMULATOR_ARGS = ["--mm", "kimi", "--step-ms", "0", "--median-tokens", "32", "--sigma", "0"]
EMULATOR_ARGS += ["--vision-ms-per-1k-tokens", "0", "--max-running", "64", "--log-level", "WARNING"]
QUESTIONS = ("Describe the image.", "What is in the picture?", "Name the colours you see.")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--distinct", type=int, default=2_500, help="distinct images")
    p.add_argument("--items", type=int, default=400, help="items per generation run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skip-generate", action="store_true", help="measure the enqueue only")
    return p.parse_args()


def write_image(path: Path, rng: random.Random) -> None:
    """An image 256–2048 px a side whose pixels depend on rng: a colour field with rectangles;
    a JPEG ("photo") also gets grain over it, so that it compresses about as a photo does, a
    PNG ("screenshot") stays flat."""
    from PIL import Image, ImageDraw

    width, height = rng.randint(256, 2048), rng.randint(256, 2048)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(8):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = rng.randrange(x0, width + 1), rng.randrange(y0, height + 1)
        draw.rectangle((x0, y0, x1, y1), fill=tuple(rng.randrange(256) for _ in range(3)))
    if path.suffix == ".png":
        image.save(path, format="PNG")
        return
    grain = [Image.effect_noise((width // 2, height // 2), 40) for _ in range(3)]
    image = Image.blend(image, Image.merge("RGB", grain).resize((width, height)), 0.2)
    image.save(path, format="JPEG", quality=85)


def write_images(folder: Path, count: int, seed: int) -> list[str]:
    """count images in folder/img (9 in 10 JPEG); their paths relative to folder."""
    rng = random.Random(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        name = f"img/{i:05d}.{'png' if i % 10 == 0 else 'jpg'}"
        write_image(folder / name, rng)
        names.append(name)
    return names


def image_message(sources: list[str], question: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": source}} for source in sources
    ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def write_rows(path: Path, count: int, images: list[str], seed: int) -> Counter[str]:
    """count rows over images: every image in at least one row, the rest drawn with Zipf-like
    weights (rank^-1.1); a row holds one image (70%), two (25%) or three. Returns how many
    times each image is referenced."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(len(images))]
    uses: Counter[str] = Counter()
    with path.open("w", encoding="utf-8") as out:
        for i in range(count):
            k = rng.choices((1, 2, 3), weights=(70, 25, 5))[0]
            chosen = [images[i]] if i < len(images) else []
            chosen += rng.choices(images, weights=weights, k=k - len(chosen))
            uses.update(chosen)
            row = {"id": f"r{i:06d}", "messages": image_message(chosen, rng.choice(QUESTIONS))}
            out.write(json.dumps(row, separators=(",", ":")) + "\n")
    return uses


def count_opens(folder: Path) -> Counter[str]:
    """Every later open of a file under folder, counted by path (an audit hook: it sees
    `open`, `os.open` and Pillow's opens alike; it stays for the life of the process)."""
    opened: Counter[str] = Counter()
    prefix = str(folder.resolve()) + os.sep

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], str | Path):
            path = os.path.abspath(args[0])
            if path.startswith(prefix):
                opened[path] += 1

    sys.addaudithook(hook)
    return opened


def settings_for(tmp: Path, pg_url: str) -> Any:
    """This process's settings: the benchmark's database, no broker, the image store in tmp
    (the enqueue reads TOKENMILL_STORAGE_URL, so it is set here before anything reads it)."""
    os.environ["TOKENMILL_STORAGE_URL"] = (tmp / "store").as_uri()
    os.environ["TOKENMILL_DATA_DIR"] = str(tmp / "data")
    from app.core.settings import Settings, normalize_database_url

    return Settings(
        data_dir=tmp / "data",
        database_url=normalize_database_url(pg_url),
        broker_url=None,
        storage_url=(tmp / "store").as_uri(),
        inflight=64,
    )


def enqueue_rows(db: Any, tokenizer: Any, path: Path, run: str) -> Any:
    from app.core.contracts import SamplingParams
    from workers.intake.producer import EnqueueOptions, enqueue

    options = EnqueueOptions(
        input_path=path, run=run, sampling=SamplingParams(max_new_tokens=32, seed=1)
    )
    return enqueue(db, tokenizer, options, publish=None)


def measure_enqueue(args: argparse.Namespace, tmp: Path, pg_url: str, tokenizer: Any) -> None:
    t0 = time.perf_counter()
    images = write_images(tmp / "rows", args.distinct, args.seed)
    uses = write_rows(tmp / "rows" / "rows.jsonl", args.rows, images, args.seed)
    source_bytes = sum((tmp / "rows" / name).stat().st_size for name in images)
    print(
        f"{args.distinct} images ({source_bytes / 1e6:.0f} MB) and {args.rows} rows "
        f"({sum(uses.values())} image references) written in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    settings_for(tmp, pg_url)
    db = engine_for(pg_url)
    opened = count_opens(tmp / "rows" / "img")
    w0, c0 = time.perf_counter(), time.process_time()
    report = enqueue_rows(db, tokenizer, tmp / "rows" / "rows.jsonl", "images")
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    db.dispose()
    stored = sorted((tmp / "store" / "images").iterdir())
    stored_bytes = sum(p.stat().st_size for p in stored)
    reads = Counter(opened.values())
    never = args.distinct - len(opened)
    print()
    headers = ["rows", "inserted", "skipped", "wall s", "rows/s", "CPU s", "objects", "MB stored"]
    figures = [args.rows, report.inserted, report.skipped, wall, report.inserted / wall, cpu]
    print(table(headers, [[*figures, len(stored), stored_bytes / 1e6]]))
    print(
        f"\nimage files opened: {dict(sorted(reads.items()))} (opens: files), {never} never; "
        f"distinct images read once: {'yes' if set(reads) == {1} and not never else 'NO'}; "
        f"objects stored = distinct images: {'yes' if len(stored) == args.distinct else 'NO'}"
    )


def write_image_items(folder: Path, count: int, seed: int) -> Path:
    images = write_images(folder, count, seed)
    path = folder / "gen.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for i, name in enumerate(images):
            row = {"id": f"g{i:05d}", "messages": image_message([name], QUESTIONS[i % 3])}
            out.write(json.dumps(row) + "\n")
    return path


def write_text_items(path: Path, lengths: list[int], seed: int) -> Path:
    """Pre-tokenized prompts of exactly these lengths (ordinary ids of the fixture)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as out:
        for i, n in enumerate(lengths):
            ids = [rng.randrange(256, 2000) for _ in range(n)]
            out.write(json.dumps({"id": f"t{i:05d}", "input_ids": ids}) + "\n")
    return path


def served_lengths(db: Any, run: str) -> list[int]:
    """The served prompt length of each item: its ids, each placeholder counted as the
    number of tokens its image took."""
    from app.ledger import reads as ledger_reads
    from app.ledger import run_queries

    with db.connect() as conn:
        info = run_queries.get_run(conn, run)
        items = list(ledger_reads.iter_items(conn, info.id))
    counts = [item.image_token_counts or [] for item in items]
    return [len(item.prompt_ids) - len(c) + sum(c) for item, c in zip(items, counts, strict=True)]


def generate_run(
    db: Any, settings: Any, tokenizer: Any, path: Path, run: str, url: str
) -> tuple[float, float]:
    """Enqueue path as run, work it with the embedded runner: wall seconds of the work, and
    CPU seconds of this process (the runner's) meanwhile."""
    from app.ledger import run_queries
    from workers.engine.runner import EmbeddedRunner

    enqueue_rows(db, tokenizer, path, run)
    with db.connect() as conn:
        info = run_queries.get_run(conn, run)
    runner = EmbeddedRunner(db, settings, info, [url])
    started, cpu = time.perf_counter(), time.process_time()
    runner.start()
    try:
        counts = runner.wait()
    finally:
        runner.stop()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert counts.done == counts.total and counts.failed == 0, counts
    return elapsed, cpu


def measure_generate(args: argparse.Namespace, tmp: Path, pg_url: str, tokenizer: Any) -> None:
    settings = settings_for(tmp, pg_url)
    db = engine_for(pg_url)
    image_rows = write_image_items(tmp / "gen", args.items, args.seed + 1)
    results: list[list[float]] = []
    text_rows: Path | None = None
    with emulator([*EMULATOR_ARGS, "--tokenizer", str(fixture_tokenizer_dir())]) as emu:
        for round_ in (1, 2):
            image = generate_run(db, settings, tokenizer, image_rows, f"img{round_}", emu.url)
            if text_rows is None:
                lengths = served_lengths(db, "img1")
                text_rows = write_text_items(tmp / "gen" / "text.jsonl", lengths, args.seed)
            text = generate_run(db, settings, tokenizer, text_rows, f"txt{round_}", emu.url)
            results.append([round_, *(1000 * x / args.items for x in (*image, *text))])
    lengths = served_lengths(db, "img1")
    db.dispose()
    print(
        f"\n{args.items} items a run, served prompts of {min(lengths)}–{max(lengths)} ids "
        f"(mean {sum(lengths) / len(lengths):.0f}), 32 output ids each"
    )
    headers = ["round", "image ms/item", "text ms/item", "image / text"]
    headers += ["image CPU ms/item", "text CPU ms/item"]
    print(table(headers, [[r, i, t, i / t, ic, tc] for r, i, ic, t, tc in results]))
    wall = sum(r[1] for r in results) / sum(r[3] for r in results)
    cpu = sum(r[2] for r in results) / sum(r[4] for r in results)
    print(
        f"\ngeneration overhead of an image item: {wall:.2f}× a text item of the same served "
        f"length in wall time, {cpu:.2f}× in the runner's CPU"
    )


def main() -> None:
    args = parse_args()
    print(f"images benchmark — {machine_note()}")
    from app.prompts.tokenization import load_tokenizer

    tokenizer = load_tokenizer(fixture_tokenizer_dir())
    with tempfile.TemporaryDirectory(prefix="tm-bench-img-") as tmp, bench_database() as pg_url:
        measure_enqueue(args, Path(tmp), pg_url, tokenizer)
        if not args.skip_generate:
            measure_generate(args, Path(tmp), pg_url, tokenizer)


if __name__ == "__main__":
    main()
