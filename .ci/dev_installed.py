"""Exit 0 when tokenmill and every requirement of its core and `dev` extra are installed.

`make install` runs this first and calls pip only when it fails, so `make test` stays quick.
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def missing(requirements: list[str]) -> list[str]:
    """The requirements that no installed distribution satisfies."""
    out = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(line)
            continue
        if not req.specifier.contains(version, prereleases=True):
            out.append(f"{line} (installed {version})")
    return out


def main() -> int:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = [project["name"], *project["dependencies"], *project["optional-dependencies"]["dev"]]
    absent = missing(wanted)
    for line in absent:
        print(f"not installed: {line}", file=sys.stderr)
    return 1 if absent else 0


if __name__ == "__main__":
    sys.exit(main())
