"""Bad input through the real `tokenmill enqueue` on Postgres + Redis, table-driven.

A bad line is skipped with its line number and reason while every good line of the same file
is enqueued (exactly good lines × samples, nothing half-written). A bad argument or an
unusable prompts file exits 2 with one clear line, no traceback, and nothing in the ledger
(so nothing was published: ids are published only after their rows commit). Passwords of
the configured URLs never reach the CLI's output.

Redis db 11 may be shared with other test sessions, so nothing here counts keys in it: an
item in state `queued` is one whose publish returned.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import pytest
from sqlalchemy import Engine, func, select

from app.ledger import common, reads, run_queries
from app.prompts.inputs import DEFAULT_MAX_LINE_BYTES
from tests.support.procs import clean_env, service_env, tokenmill

SAMPLES = 2
RUN = "bad-input"


def good(key: str) -> bytes:
    return json.dumps({"id": key, "messages": [{"role": "user", "content": f"Hi {key}"}]}).encode()


def jsonl(value: object) -> bytes:
    return json.dumps(value).encode()


HUGE = b"<a line one byte over the limit, written when the file is>"


@dataclass(frozen=True)
class BadLine:
    name: str
    line: bytes
    reason: str  # expected in the message after "line N: "


# Each bad line sits between good ones; the last case is the file's unterminated last line.
BAD_LINES = [
    BadLine("invalid JSON", b'{"id": "j", "prompt": "x",}', "invalid JSON: "),
    BadLine("not an object", b'["a", "b"]', "line is a JSON array, not an object"),
    BadLine(
        "non-UTF-8 bytes",
        b'{"id": "u", "prompt": "caf\xe9 \xff"}',
        "line is not valid UTF-8 (bad byte at offset 26)",
    ),
    BadLine("missing turns", jsonl({"id": "m"}), "no prompt field: expected one of 'messages'"),
    BadLine("null turns", jsonl({"id": "m2", "messages": None}), "no prompt field"),
    BadLine("empty messages", jsonl({"id": "e", "messages": []}), "'messages' is empty"),
    BadLine(
        "empty conversations", jsonl({"id": "e2", "conversations": []}), "'conversations' is empty"
    ),
    BadLine(
        "a Responses-API part the chat endpoint refuses",
        jsonl({"id": "e3", "messages": [{"role": "user", "content": [{"type": "input_text"}]}]}),
        'messages[0].content[0] is a "input_text" part; tokenmill takes text and image parts',
    ),
    BadLine(
        "unknown role",
        jsonl({"id": "r", "messages": [{"role": "wizard", "content": "x"}]}),
        'messages[0] has unknown role "wizard"',
    ),
    BadLine(
        "unknown role that looks like console markup",
        jsonl({"id": "r2", "messages": [{"role": "[/red]", "content": "x"}]}),
        'messages[0] has unknown role "[/red]"',
    ),
    BadLine(
        "unknown ShareGPT speaker",
        jsonl({"id": "r3", "conversations": [{"from": "alien", "value": "x"}]}),
        "conversations[0] has unknown 'from' \"alien\"",
    ),
    BadLine(
        "numeric content",
        jsonl({"id": "c", "messages": [{"role": "user", "content": 42}]}),
        "messages[0].content must be a string or a list of text and image parts, not a JSON number",
    ),
    BadLine(
        "object content",
        jsonl({"id": "c2", "messages": [{"role": "user", "content": {"text": "x"}}]}),
        "not a JSON object",
    ),
    BadLine(
        "image part without a reference",
        jsonl({"id": "c3", "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
        "messages[0].content[0] has no image reference (a non-empty string 'image')",
    ),
    BadLine(
        "video part",
        jsonl(
            {
                "id": "c4",
                "messages": [
                    {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "v"}}]}
                ],
            }
        ),
        'messages[0].content[0] is a "video_url" part; tokenmill takes text and image parts',
    ),
    BadLine(
        "missing image",
        jsonl(
            {
                "id": "c5",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "cats/none.png"}}],
                    }
                ],
            }
        ),
        "messages[0].content[0]: image 'cats/none.png' cannot be read: No such file",
    ),
    # The limit is not an option of the CLI: the line is 32 MiB + 1 byte, written in pieces.
    BadLine(
        "line over the size limit", HUGE, f"line is longer than {DEFAULT_MAX_LINE_BYTES} bytes"
    ),
    BadLine("duplicate id", good("g00"), "duplicate id 'g00' (first seen on line 1)"),
    BadLine(
        "duplicate content without ids",
        jsonl({"prompt": "same words"}),
        "duplicate prompt: same content as line",
    ),
    BadLine(
        "truncated last line",
        b'{"id": "t", "messages": [{"role": "user", "content": "cut he',
        "truncated last line: no newline at the end of the file",
    ),
]


def write_huge_line(out: BinaryIO) -> None:
    """A valid JSON object of DEFAULT_MAX_LINE_BYTES + 1 bytes without holding it in memory."""
    head, tail = b'{"id": "huge", "prompt": "', b'"}'
    left = DEFAULT_MAX_LINE_BYTES + 1 - len(head) - len(tail)
    out.write(head)
    piece = b"x" * (1 << 20)
    while left > 0:
        out.write(piece[:left])
        left -= len(piece)
    out.write(tail)


def bad_lines_file(path: Path) -> tuple[dict[int, BadLine], list[str]]:
    """good, bad, good, bad, ... with the truncated line last; (bad by line number, keys of the
    good lines that have an id)."""
    keys = ["g00"]
    bad: dict[int, BadLine] = {}
    with path.open("wb") as out:
        out.write(good("g00") + b"\n" + jsonl({"prompt": "same words"}) + b"\n")
        line_no = 2
        for index, case in enumerate(BAD_LINES):
            line_no += 1
            bad[line_no] = case
            if case.line is HUGE:
                write_huge_line(out)
            else:
                out.write(case.line)
            if case is BAD_LINES[-1]:
                break  # the truncated last line: no newline after it
            keys.append(f"g{index + 1:02}")
            out.write(b"\n" + good(keys[-1]) + b"\n")
            line_no += 1
    return bad, keys


def own_lines(stderr: str) -> list[str]:
    """tokenmill's stderr lines: blank lines and transformers' import advisory left out."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("[transformers]")]


def enqueue(
    env: dict[str, str], path: Path, tokenizer: Path, *extra: str, run: str = RUN
) -> subprocess.CompletedProcess[str]:
    args = ["enqueue", str(path), "--run", run, "--tokenizer", str(tokenizer), "--json"]
    return tokenmill([*args, "--samples-per-prompt", str(SAMPLES), "--seed", "1", *extra], env)


@pytest.fixture
def env(pg_engine: Engine, redis_url: str, pg_url: str, tmp_path: Path) -> dict[str, str]:
    return service_env(pg_url, redis_url, tmp_path / "data")


def test_bad_lines_are_skipped_by_number_and_every_good_line_is_enqueued(
    env: dict[str, str],
    pg_engine: Engine,
    kimi_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    path = tmp_path / "prompts.jsonl"
    bad, good_keys = bad_lines_file(path)
    proc = enqueue(env, path, kimi_tokenizer_dir)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr

    skipped = {}
    for text in own_lines(proc.stderr):
        if text.startswith(f"skipped {path} line "):
            number = int(text.split(" line ", 1)[1].split(":", 1)[0])
            skipped[number] = text.split(f" line {number}: ", 1)[1]
    wrong = {
        f"line {n} ({case.name})": skipped.get(n)
        for n, case in bad.items()
        if case.reason not in (skipped.get(n) or "")
    }
    assert wrong == {}, proc.stderr[-4000:]
    assert sorted(skipped) == sorted(bad), "a good line was skipped or a bad one went unreported"

    report = json.loads(proc.stdout)
    # each stage reports the lines it refuses as it meets them (an image after the reading)
    assert sorted(e["line"] for e in report["errors"]) == sorted(bad)
    assert report["prompts"] == len(good_keys) + 1  # + the first "same words" line
    assert report["inserted"] == report["published"] == (len(good_keys) + 1) * SAMPLES

    with pg_engine.connect() as conn:
        run = run_queries.get_run(conn, RUN)
        rows = list(reads.iter_items(conn, run.id, statuses=("pending", "queued")))
        counts = reads.run_counts(conn, run)
    keys = {(row.item_key, row.sample_index) for row in rows}
    explicit = {(key, k) for key in good_keys for k in range(SAMPLES)}
    assert explicit <= keys and len(keys) == len(rows) == (len(good_keys) + 1) * SAMPLES
    assert counts.total == counts.queued == len(rows)
    assert all(row.prompt_ids for row in rows)

    # Running it again adds nothing and reports the same lines.
    again = enqueue(env, path, kimi_tokenizer_dir)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert (report["inserted"], report["already_present"]) == (0, len(good_keys) + 1)
    # each stage reports the lines it refuses as it meets them (an image after the reading)
    assert sorted(e["line"] for e in report["errors"]) == sorted(bad)


def no_template_tokenizer(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    config = dest / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    (dest / "chat_template.jinja").unlink(missing_ok=True)
    return dest


@dataclass(frozen=True)
class BadArgument:
    name: str
    args: tuple[str, ...] = ()
    tokenizer: str | None = None  # "missing", "file" or "no-template" instead of the fixture
    prompts: bytes | None = None  # the prompts file instead of good lines; b"-" for no file
    gz: bool = False
    says: tuple[str, ...] = ()


BAD_ARGUMENTS = [
    BadArgument("tokenizer path missing", tokenizer="missing", says=("--tokenizer", "not exist")),
    BadArgument("tokenizer path is a file", tokenizer="file", says=("--tokenizer", "not a folder")),
    BadArgument(
        "tokenizer without a chat template",
        tokenizer="no-template",
        says=("--tokenizer", "has no chat template"),
    ),
    BadArgument(
        "template kwargs not JSON",
        args=("--chat-template-kwargs", "{thinking: false}"),
        says=("--chat-template-kwargs", "is not valid JSON"),
    ),
    BadArgument(
        "template kwargs a JSON array",
        args=("--chat-template-kwargs", '["thinking"]'),
        says=("--chat-template-kwargs", "must be a JSON object", "not a JSON array"),
    ),
    BadArgument(
        "template kwargs a JSON string",
        args=("--chat-template-kwargs", '"thinking"'),
        says=("--chat-template-kwargs", "not a JSON string"),
    ),
    BadArgument("empty prompts file", prompts=b"", says=("prompts file", "is empty")),
    BadArgument("only blank lines", prompts=b"\n  \n\r\n", says=("prompts file", "is empty")),
    BadArgument("no prompts file", prompts=b"-", says=("cannot open the prompts file",)),
    BadArgument(
        "a .gz file that is not gzip",
        gz=True,
        says=("cannot read the prompts file", "Not a gzipped file"),
    ),
]


@pytest.mark.parametrize("case", BAD_ARGUMENTS, ids=[c.name for c in BAD_ARGUMENTS])
def test_bad_arguments_exit_2_with_one_line_and_write_nothing(
    case: BadArgument,
    env: dict[str, str],
    pg_engine: Engine,
    kimi_tokenizer_dir: Path,
    tmp_path: Path,
) -> None:
    path = tmp_path / ("prompts.jsonl.gz" if case.gz else "prompts.jsonl")
    if case.prompts != b"-":
        default = b"".join(good(f"k{i}") + b"\n" for i in range(3))
        path.write_bytes(default if case.prompts is None else case.prompts)
    tokenizer = {
        None: kimi_tokenizer_dir,
        "missing": tmp_path / "no-such-tokenizer",
        "file": kimi_tokenizer_dir / "tokenizer.json",
        "no-template": tmp_path / "plain-tokenizer",
    }[case.tokenizer]
    if case.tokenizer == "no-template":
        no_template_tokenizer(kimi_tokenizer_dir, tokenizer)

    proc = enqueue(env, path, tokenizer, *case.args)

    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = own_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert all(part in lines[0] for part in case.says), lines[0]
    with pg_engine.connect() as conn:
        assert run_queries.list_runs(conn) == []
        assert conn.execute(select(func.count()).select_from(common.items)).scalar_one() == 0


def test_a_truncated_gzip_file_is_a_clear_error(
    env: dict[str, str], pg_engine: Engine, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    whole = gzip.compress(b"".join(good(f"z{i}") + b"\n" for i in range(300)))
    path = tmp_path / "prompts.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    proc = enqueue(env, path, kimi_tokenizer_dir)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Aborted" not in proc.stderr
    lines = own_lines(proc.stderr)
    assert len(lines) == 1 and "cannot read the prompts file" in lines[0], proc.stderr
    assert "after line" in lines[0]
    with pg_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(common.items)).scalar_one() == 0


SECRET = "secretpw"


def assert_one_clean_error(proc: subprocess.CompletedProcess[str]) -> None:
    out = proc.stdout + proc.stderr
    assert SECRET not in out, out
    assert proc.returncode == 2, out
    assert "Traceback" not in proc.stderr, out
    assert len([ln for ln in own_lines(proc.stderr) if ln.startswith("error: ")]) == 1, out


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://u:{SECRET}@127.0.0.1:1/x",  # unreachable
        f"postgresql://u:{SECRET}%40x@127.0.0.1:1/x",  # percent-encoded password
        f"postgresql://postgres:{SECRET}@127.0.0.1:5432/no_such_db_tm",  # the server says no
        f"nosuchdb://u:{SECRET}@127.0.0.1/x",  # unknown driver
        f"postgresql://u:{SECRET}@127.0.0.1:port/x",  # port not a number
    ],
)
def test_database_passwords_never_reach_the_output(url: str, tmp_path: Path) -> None:
    env = clean_env(tmp_path / "data", TOKENMILL_DATABASE_URL=url)
    assert_one_clean_error(tokenmill(["status"], env))
    config = tokenmill(["config"], env)
    assert config.returncode == 0, config.stderr
    assert SECRET not in config.stdout + config.stderr
    assert ":***@" in json.loads(config.stdout)["database_url"]


def test_passwords_stay_out_of_enqueue_and_debug_logs(
    kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    env = clean_env(
        tmp_path / "data", TOKENMILL_DATABASE_URL=f"postgresql://u:{SECRET}@127.0.0.1:1/x"
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(good("a") + b"\n")
    args = ["enqueue", str(prompts), "--run", "r", "--tokenizer", str(kimi_tokenizer_dir)]
    assert_one_clean_error(tokenmill(["--log-level", "DEBUG", *args], env))
    assert_one_clean_error(tokenmill(["--log-level", "DEBUG", "status", "--json"], env))


def test_broker_passwords_never_reach_the_config_output(tmp_path: Path) -> None:
    env = clean_env(tmp_path / "data", TOKENMILL_BROKER_URL=f"redis://:{SECRET}@127.0.0.1:1/0")
    config = tokenmill(["config"], env)
    assert config.returncode == 0, config.stderr
    assert SECRET not in config.stdout + config.stderr
    assert json.loads(config.stdout)["broker_url"] == "redis://:***@127.0.0.1:1/0"
