"""SGLang's published JSON contract (`sglang/api/v1/api_types.py`), loaded without importing sglang.

The sglang package pulls in torch; this module only needs msgspec. The wheel is fetched once with
`pip download sglang==<version> --no-deps` into `<repo>/.cache/sglang-wheel` and that one file is
extracted next to it. Use `load_contract().GenerateRequest.from_json_value(body)` (raises
`JsonContractError`, SGLang's HTTP 400) and `...GenerateResponse.from_json_value(resp)`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

SGLANG_VERSION = "0.5.23"
CONTRACT_MEMBER = "sglang/api/v1/api_types.py"
REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO_ROOT / ".cache" / "sglang-wheel"
MODULE_NAME = "sglang_api_v1_api_types"


def _wheel(cache_dir: Path, version: str) -> Path:
    pattern = f"sglang-{version}-*.whl"
    found = sorted(cache_dir.glob(pattern))
    if found:
        return found[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", f"sglang=={version}",
        "--no-deps", "--disable-pip-version-check", "-d", str(cache_dir),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(cache_dir.glob(pattern))
    if result.returncode != 0 or not found:
        raise RuntimeError(
            f"could not fetch the sglang {version} wheel into {cache_dir}: {result.stderr[-2000:]}"
        )
    return found[0]


def contract_path(cache_dir: Path = CACHE_DIR, version: str = SGLANG_VERSION) -> Path:
    """The extracted api_types.py, fetching the wheel and extracting it on first use."""
    target = cache_dir / f"api_types-{version}.py"
    if target.exists():
        return target
    with zipfile.ZipFile(_wheel(cache_dir, version)) as wheel:
        source = wheel.read(CONTRACT_MEMBER)
    # write then rename: concurrent test processes never see half a file
    handle, temporary = tempfile.mkstemp(dir=cache_dir, suffix=".py.part")
    with os.fdopen(handle, "wb") as out:
        out.write(source)
    os.replace(temporary, target)
    return target


@functools.cache
def load_contract() -> ModuleType:
    """SGLang's contract module (GenerateRequest, GenerateResponse, JsonContractError, ...)."""
    path = contract_path()
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module  # msgspec resolves the Struct annotations through it
    spec.loader.exec_module(module)
    return module


def validate_request(body: Any) -> Any:
    """A /generate body through SGLang's schema gate; raises JsonContractError when it is a 400."""
    return load_contract().GenerateRequest.from_json_value(body)


def decode_response(body: Any) -> Any:
    """A /generate answer (one object, or a list for a batch) decoded as GenerateResponse(s)."""
    decode = load_contract().GenerateResponse.from_json_value
    if isinstance(body, list):
        return [decode(item) for item in body]
    return decode(body)
