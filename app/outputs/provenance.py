"""What made each exported sample: its weight version and its full sampling_params, the
rule that one export holds one weight version (unless asked otherwise), and the counts a
Parquet manifest keeps per weight version and per sampling setting."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from app.core.errors import ConfigurationError
from app.ledger import reads, run_queries


def provenance(item: reads.StoredItem) -> dict[str, Any]:
    """The fields every exported sample carries: `weight_version` and `sampling_params`."""
    return {"weight_version": item.weight_version, "sampling_params": item.sampling_params}


def weight_filter(
    conn: Connection, run: run_queries.RunInfo, weight_version: str | None, allow_mixed: bool
) -> Callable[[reads.StoredItem], bool]:
    """Which done samples an export takes: those of weight_version when it is given; else all,
    refused (ConfigurationError) when they come from several versions and mixing is not
    allowed: a draft trained on two targets' outputs is the failure exports must not hide."""
    versions = reads.done_weight_versions(conn, run.id)
    if weight_version is not None:
        if weight_version not in versions:
            raise ConfigurationError(
                f"run {run.name} has no done samples of weight_version {weight_version!r} "
                f"(it has: {_listed(versions)})"
            )
        return lambda item: item.weight_version == weight_version
    if len(versions) > 1 and not allow_mixed:
        raise ConfigurationError(
            f"run {run.name} holds samples of {len(versions)} weight versions "
            f"({_listed(versions)}); export one with --weight-version V, or all of them with "
            "--allow-mixed-weights"
        )
    return lambda item: True


def _listed(versions: dict[str | None, int]) -> str:
    return ", ".join(f"{v}: {n}" for v, n in sorted(versions.items(), key=lambda kv: str(kv[0])))


@dataclass
class ProvenanceCounts:
    """Samples per weight version and per distinct sampling setting (its full params)."""

    weight_versions: dict[str, int] = field(default_factory=dict)
    sampling: dict[str, int] = field(default_factory=dict)

    def add(self, item: reads.StoredItem) -> None:
        version = str(item.weight_version)
        self.weight_versions[version] = self.weight_versions.get(version, 0) + 1
        # the seed differs per sample by design; a setting is everything else
        setting = {k: v for k, v in (item.sampling_params or {}).items() if k != "sampling_seed"}
        key = json.dumps(setting, sort_keys=True)
        self.sampling[key] = self.sampling.get(key, 0) + 1

    def to_json(self) -> dict[str, Any]:
        return {
            "per_weight_version": dict(sorted(self.weight_versions.items())),
            "per_sampling": [
                {"sampling_params": json.loads(key), "samples": n}
                for key, n in sorted(self.sampling.items())
            ],
        }
