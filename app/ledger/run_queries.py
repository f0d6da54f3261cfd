"""Runs: what a run pins when it is created (RunSpec), how it reads back (RunInfo), the check
that a later enqueue pins the same settings, its server fingerprint and whether it is archived;
its storage URL and which servers serve it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, insert, select, update

from app.core.constants import NORMALIZATION_VERSION
from app.core.contracts import SamplingParams
from app.core.errors import NotFound, RunArchived, RunMismatch
from app.core.run_kinds import RunKind, TurnsMode
from app.ledger import common, pin_checks


@dataclass(frozen=True)
class RunSpec:
    """What a run pins when it is created; a later enqueue must match it. Flat as the CLI
    gives it: the run's own settings (name, kind, weight version, storage, servers, driver)
    read back as RunInfo's fields, the others as its GenerationSettings."""

    name: str
    tokenizer_path: str
    tokenizer_hash: str
    chat_template_hash: str
    chat_template_kwargs: dict[str, Any]
    sampling: SamplingParams
    samples_per_prompt: int
    think_end_id: int | None
    eos_token_ids: list[int]
    # `--turns all`: every assistant turn regenerated, chained (pinned)
    turns: TurnsMode = TurnsMode.LAST
    # the tokenizer's own code allowed: export, verify, reports and later turns load it so too
    trust_remote_code: bool = False
    # `--render-with URL`: prompts built by that server's /v1/tokenize (pinned)
    render_with: str | None = None
    require_parity: bool = False
    # sha256 of each tokenizer file (a later enqueue names the one that changed), and the
    # folder's hash by the rule of runs created before the manifest, to compare those with
    tokenizer_files: dict[str, str] | None = None
    legacy_tokenizer_hash: str | None = None
    # the message-normalization rules the prompts are built with (app.prompts.chat_path)
    normalization_version: str = NORMALIZATION_VERSION
    # template choice, transformers versions, --pass-turn-fields (app.prompts.chat_pins)
    chat_pins: dict[str, Any] | None = None
    # `--weight-version V`: only servers reporting V serve the run
    weight_version: str | None = None
    # `--reasoning-effort a,b,c`: sample k is templated with the k-th effort (modulo)
    reasoning_efforts: tuple[str | float, ...] = ()
    # where its images and shards live (app.storage.run_store.pinned_url); a later enqueue
    # stores into the run's, whatever its own setting
    storage_url: str | None = None
    # `enqueue --servers NAME...`: only these registered servers serve the run
    servers: tuple[str, ...] | None = None
    # DRIVER_RUN: `tokenmill run` drives it (the fleet leaves it alone); None: the fleet's
    driver: str | None = None
    kind: RunKind = RunKind.GENERATE
    # `--priority N`: higher first (None: 0 for a new run, the run's own for a later enqueue)
    priority: int | None = None

    def __post_init__(self) -> None:
        # the stored and CLI form is the mode's string: a spec built from it reads typed
        object.__setattr__(self, "turns", TurnsMode(self.turns))
        object.__setattr__(self, "kind", RunKind(self.kind))


# runs.driver of a run `tokenmill run` drives
DRIVER_RUN = "run"


@dataclass(frozen=True)
class GenerationSettings:
    """What a generation run pins about templating, sampling and turns (runs.kind 'generate'):
    read from the run's row with the rest of it."""

    tokenizer_path: str
    tokenizer_hash: str
    chat_template_hash: str
    chat_template_kwargs: dict[str, Any]
    sampling: SamplingParams
    samples_per_prompt: int
    think_end_id: int | None
    eos_token_ids: list[int]
    turns: TurnsMode = TurnsMode.LAST
    trust_remote_code: bool = False
    render_with: str | None = None
    require_parity: bool = False
    tokenizer_files: dict[str, str] | None = None
    # None: created before the rules were pinned (app.prompts.chat_path.check_version refuses it)
    normalization_version: str | None = None
    chat_pins: dict[str, Any] | None = None
    reasoning_efforts: tuple[str | float, ...] = ()

    @property
    def tool_call_parser(self) -> str | None:
        """`--turns all` on agentic rows: the pinned parser of the target's calls."""
        parser = (self.chat_pins or {}).get("tool_call_parser")
        return None if parser is None else str(parser)


@dataclass(frozen=True)
class RunInfo:
    """A run as it reads back: what every run has (its name, kind, which servers serve it and
    who drives it, where its files live) and what its kind pins (`generation`). A run-level
    setting that is not about one kind (a scheduling attribute, say) is a field here."""

    id: int
    name: str
    generation: GenerationSettings
    fingerprint: dict[str, Any] | None
    created_at: datetime
    kind: RunKind = RunKind.GENERATE
    weight_version: str | None = None
    # None: a run created before its storage was pinned (readers use their own setting)
    storage_url: str | None = None
    servers: tuple[str, ...] | None = None
    driver: str | None = None
    # free slots go to the highest-priority run first (changed live by `tokenmill priority`)
    priority: int = 0

    @property
    def fleet_run(self) -> bool:
        """Served by the fleet's workers and reconcile (not a run `tokenmill run` drives)."""
        return self.driver != DRIVER_RUN

    def served_by(self, server: str) -> bool:
        """Whether a fleet worker of this server may take the run's items."""
        return self.fleet_run and (self.servers is None or server in self.servers)

    def binding(self) -> str:
        """Which servers serve the run, as `status` shows it."""
        if not self.fleet_run:
            return "`tokenmill run` only (its --server URLs; the fleet leaves it alone)"
        if self.servers is None:
            return "any server of the fleet"
        return ", ".join(self.servers) + " (enqueue --servers)"


# The run's turn mode rides in its pinned sampling_params JSON (no column of its own), under
# a key SamplingParams does not have; present only for `--turns all`, so older runs read "last".
_TURNS_KEY = "turns"
# the same for the reasoning-effort cycle (a template input per sample, not a sampling value)
_EFFORTS_KEY = "reasoning_effort_cycle"


def _generation(row: Any) -> GenerationSettings:
    pinned = dict(row.sampling_params)
    turns = TurnsMode(pinned.pop(_TURNS_KEY, TurnsMode.LAST))
    efforts = tuple(pinned.pop(_EFFORTS_KEY, ()))
    return GenerationSettings(
        tokenizer_path=row.tokenizer_path,
        tokenizer_hash=row.tokenizer_hash,
        chat_template_hash=row.chat_template_hash,
        chat_template_kwargs=row.chat_template_kwargs or {},
        sampling=SamplingParams.from_json(pinned),
        samples_per_prompt=row.samples_per_prompt,
        think_end_id=row.think_end_id,
        eos_token_ids=list(row.eos_token_ids or []),
        turns=turns,
        render_with=row.render_with,
        require_parity=bool(row.require_parity),
        trust_remote_code=bool(row.trust_remote_code),
        tokenizer_files=dict(row.tokenizer_files) if row.tokenizer_files is not None else None,
        normalization_version=row.normalization_version,
        chat_pins=dict(row.chat_pins) if row.chat_pins is not None else None,
        reasoning_efforts=efforts,
    )


def _run_info(row: Any) -> RunInfo:
    return RunInfo(
        id=row.id,
        name=row.name,
        generation=_generation(row),
        fingerprint=row.fingerprint,
        created_at=common.as_utc(row.created_at) or common.utcnow(),
        kind=RunKind(row.kind),
        weight_version=row.weight_version,
        storage_url=row.storage_url,
        servers=tuple(row.servers) if row.servers is not None else None,
        driver=row.driver,
        priority=int(row.priority),
    )


def _changed(label: str, old: object, new: object) -> list[str]:
    """`label: old → new` when the two differ, else nothing."""
    return [] if old == new else [f"{label}: {old} → {new}"]


def run_differences(existing: RunInfo, spec: RunSpec) -> list[str]:
    """Lines naming every pinned setting in which spec differs from the existing run."""
    gen = existing.generation
    diffs = _changed("kind", existing.kind, spec.kind)
    diffs += _tokenizer_differences(gen, spec)
    if gen.chat_template_hash != spec.chat_template_hash:
        diffs.append(
            f"chat template hash: {gen.chat_template_hash[:12]} → {spec.chat_template_hash[:12]}"
        )
    diffs += _changed("chat template kwargs", gen.chat_template_kwargs, spec.chat_template_kwargs)
    old, new = gen.sampling.to_json(), spec.sampling.to_json()
    for key in sorted(set(old) | set(new)):
        diffs += _changed(key, old.get(key), new.get(key))
    diffs += _changed("samples per prompt", gen.samples_per_prompt, spec.samples_per_prompt)
    diffs += _changed("turns", gen.turns, spec.turns)
    diffs += _changed("render with", gen.render_with, spec.render_with)
    diffs += _changed("require parity", gen.require_parity, spec.require_parity)
    if spec.chat_pins is not None:
        diffs += pin_checks.pin_differences(gen.chat_pins, spec.chat_pins)
    diffs += _changed("weight version", existing.weight_version, spec.weight_version)
    efforts = list(gen.reasoning_efforts), list(spec.reasoning_efforts)
    diffs += _changed("reasoning effort cycle", *efforts)
    return diffs + _binding_differences(existing, spec)


def _tokenizer_differences(gen: GenerationSettings, spec: RunSpec) -> list[str]:
    if spec.tokenizer_files is not None:
        return pin_checks.file_changes(
            gen.tokenizer_hash,
            gen.tokenizer_files,
            spec.tokenizer_hash,
            spec.tokenizer_files,
            spec.legacy_tokenizer_hash or spec.tokenizer_hash,
        )
    if gen.tokenizer_hash == spec.tokenizer_hash:  # a spec built by hand: the hashes alone
        return []
    return [
        f"tokenizer: {gen.tokenizer_path} (hash {gen.tokenizer_hash[:12]}) → "
        f"{spec.tokenizer_path} (hash {spec.tokenizer_hash[:12]})"
    ]


def _binding_differences(existing: RunInfo, spec: RunSpec) -> list[str]:
    """Who drives the run, its priority and the servers it keeps to."""
    diffs: list[str] = []
    if existing.driver != spec.driver:
        drivers = {None: "tokenmill enqueue (the fleet)", DRIVER_RUN: "tokenmill run"}
        diffs.append(
            f"driven by: {drivers.get(existing.driver, existing.driver)} → "
            f"{drivers.get(spec.driver, spec.driver)}"
        )
    if spec.priority is not None and existing.priority != spec.priority:
        diffs.append(
            f"priority: {existing.priority} → {spec.priority} "
            f"(`tokenmill priority {existing.name} {spec.priority}` changes a live run's)"
        )
    if spec.servers is not None and existing.servers != spec.servers:
        old_s = "any" if existing.servers is None else " ".join(existing.servers)
        diffs.append(f"servers: {old_s} → {' '.join(spec.servers)}")
    return diffs


def get_run(conn: Connection, name: str) -> RunInfo:
    row = conn.execute(select(common.runs).where(common.runs.c.name == name)).first()
    if row is None:
        raise NotFound(f"no run named {name!r}")
    return _run_info(row)


def get_run_by_id(conn: Connection, run_id: int) -> RunInfo:
    row = conn.execute(select(common.runs).where(common.runs.c.id == run_id)).first()
    if row is None:
        raise NotFound(f"no run with id {run_id}")
    return _run_info(row)


def list_runs(conn: Connection) -> list[RunInfo]:
    return [_run_info(r) for r in conn.execute(select(common.runs).order_by(common.runs.c.id))]


def get_or_create_run(conn: Connection, spec: RunSpec) -> tuple[RunInfo, bool]:
    """The run named spec.name, created if new; RunMismatch if it pins other settings."""
    try:
        existing = get_run(conn, spec.name)
    except NotFound:
        existing = None
    if existing is not None:
        if run_archived(conn, existing.id):
            raise RunArchived(
                f"run {spec.name!r} is archived (its items left the ledger after it finished "
                "and was compacted); enqueue into a new --run name"
            )
        diffs = run_differences(existing, spec)
        if diffs:
            raise RunMismatch(
                f"run {spec.name!r} already exists with other settings; "
                "use a new --run name or the original settings. Differences: " + "; ".join(diffs)
            )
        return existing, False
    conn.execute(
        insert(common.runs).values(
            name=spec.name,
            kind=spec.kind.value,
            tokenizer_path=spec.tokenizer_path,
            tokenizer_hash=spec.tokenizer_hash,
            chat_template_hash=spec.chat_template_hash,
            chat_template_kwargs=spec.chat_template_kwargs,
            sampling_params=_pinned_sampling(spec),
            samples_per_prompt=spec.samples_per_prompt,
            think_end_id=spec.think_end_id,
            eos_token_ids=spec.eos_token_ids,
            render_with=spec.render_with,
            require_parity=spec.require_parity,
            trust_remote_code=spec.trust_remote_code,
            tokenizer_files=spec.tokenizer_files,
            created_at=common.utcnow(),
            normalization_version=spec.normalization_version,
            chat_pins=spec.chat_pins,
            weight_version=spec.weight_version,
            storage_url=spec.storage_url,
            servers=list(spec.servers) if spec.servers is not None else None,
            driver=spec.driver,
            priority=spec.priority or 0,
        )
    )
    return get_run(conn, spec.name), True


def _pinned_sampling(spec: RunSpec) -> dict[str, Any]:
    pinned = spec.sampling.to_json()
    if not spec.turns.final_only:
        pinned[_TURNS_KEY] = spec.turns.value
    if spec.reasoning_efforts:
        pinned[_EFFORTS_KEY] = list(spec.reasoning_efforts)
    return pinned


def run_archived(conn: Connection, run_id: int) -> bool:
    """Whether the run's items were moved to items_archive (app.ledger.archive)."""
    stmt = select(common.runs.c.archived_at).where(common.runs.c.id == run_id)
    return conn.execute(stmt).scalar() is not None


def pin_fingerprint(conn: Connection, run_id: int, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """Record the server fingerprint the first time a run sees one; return the pinned one."""
    conn.execute(
        update(common.runs)
        .where(common.runs.c.id == run_id, common.runs.c.fingerprint.is_(None))
        .values(fingerprint=fingerprint)
    )
    pinned = conn.execute(
        select(common.runs.c.fingerprint).where(common.runs.c.id == run_id)
    ).scalar_one()
    return dict(pinned or {})


def run_name(conn: Connection, run_id: int) -> str | None:
    """The run's name (None: no such run, e.g. deleted)."""
    name: str | None = conn.execute(
        select(common.runs.c.name).where(common.runs.c.id == run_id)
    ).scalar()
    return name


def run_storage_url(conn: Connection, run_id: int) -> str | None:
    """The storage URL the run pinned (None: a run older than the pin)."""
    stmt = select(common.runs.c.storage_url).where(common.runs.c.id == run_id)
    url: str | None = conn.execute(stmt).scalar()
    return url


def set_priority(conn: Connection, name: str, priority: int) -> int:
    """Give the run named name this priority; returns the priority it had (NotFound if none)."""
    before = get_run(conn, name).priority
    conn.execute(update(common.runs).where(common.runs.c.name == name).values(priority=priority))
    return before


def run_priorities(conn: Connection, run_ids: Iterable[int] | None = None) -> dict[int, int]:
    """run id → priority, of these runs (every run without ids): one small read of runs."""
    stmt = select(common.runs.c.id, common.runs.c.priority)
    if run_ids is not None:
        stmt = stmt.where(common.runs.c.id.in_(sorted(set(run_ids))))
    return {int(r[0]): int(r[1]) for r in conn.execute(stmt)}


def item_priorities(conn: Connection, ids: Sequence[int]) -> dict[int, int]:
    """item id → its run's priority, for these items (a requeue of ids of any runs)."""
    if not ids:
        return {}
    stmt = (
        select(common.items.c.id, common.runs.c.priority)
        .join(common.runs, common.runs.c.id == common.items.c.run_id)
        .where(common.items.c.id.in_(list(ids)))
    )
    return {int(r[0]): int(r[1]) for r in conn.execute(stmt)}
