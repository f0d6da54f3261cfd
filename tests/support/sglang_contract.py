"""SGLang's published JSON contract (`sglang/api/v1/api_types.py`), loaded without importing sglang.

The sglang package pulls in torch; this module only needs msgspec. The wheel is fetched once with
`pip download sglang==<version> --no-deps` into `<repo>/.cache/sglang-wheel` and that one file is
extracted next to it. Use `load_contract().GenerateRequest.from_json_value(body)` (raises
`JsonContractError`, SGLang's HTTP 400) and `...GenerateResponse.from_json_value(resp)`.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
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


def _wheel(cache_dir: Path, version: str, package: str = "sglang") -> Path:
    """The package's wheel in cache_dir, fetched with `pip download --no-deps` on first use."""
    pattern = f"{package}-{version}-*.whl"
    found = sorted(cache_dir.glob(pattern))
    if found:
        return found[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", f"{package}=={version}",
        "--no-deps", "--disable-pip-version-check", "-d", str(cache_dir),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(cache_dir.glob(pattern))
    if result.returncode != 0 or not found:
        raise RuntimeError(
            f"could not fetch the {package} {version} wheel into {cache_dir}: "
            f"{result.stderr[-2000:]}"
        )
    return found[0]


def fetch_wheel(package: str, version: str, cache_dir: Path) -> Path:
    """A wheel of package==version in cache_dir (fetched once, without its dependencies)."""
    return _wheel(cache_dir, version, package)


def contract_path(cache_dir: Path = CACHE_DIR, version: str = SGLANG_VERSION) -> Path:
    """The extracted api_types.py, fetching the wheel and extracting it on first use."""
    return _extracted(CONTRACT_MEMBER, cache_dir / f"api_types-{version}.py", cache_dir, version)


def _extracted(member: str, target: Path, cache_dir: Path, version: str) -> Path:
    """One file of the wheel at target, extracted on first use."""
    if target.exists():
        return target
    with zipfile.ZipFile(_wheel(cache_dir, version)) as wheel:
        source = wheel.read(member)
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


# --- the OpenAI-compatible protocol models (sglang/srt/entrypoints/openai/protocol.py) -----------

PROTOCOL_MEMBER = "sglang/srt/entrypoints/openai/protocol.py"
PROTOCOL_MODULE = "sglang_openai_protocol"
# packages protocol.py imports that are not installed here (or would pull in torch); what it
# takes from them is replaced by stand-ins that validate anything
_STUBBED_PACKAGES = ("openai", "sglang", "xgrammar")


def _stand_in(name: str) -> Any:
    """A class that subclasses cleanly (TypedDict-style keywords too) and that pydantic
    validates as Any; a lower-case name is a function returning None."""
    from pydantic_core import core_schema

    if name[:1].islower():
        return lambda *args, **kwargs: None

    class StandIn:
        def __init_subclass__(cls, **kwargs: Any) -> None:
            pass

        @classmethod
        def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
            return core_schema.any_schema()

    StandIn.__name__ = StandIn.__qualname__ = name
    return StandIn


class _StubModule(ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(name)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in _STUBBED_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: ModuleType) -> None:
        pass


def load_protocol() -> ModuleType:
    """SGLang's protocol models (TokenizeRequest, TokenizeResponse, DetokenizeRequest, ...).

    Its imports of openai, sglang and xgrammar are answered by stand-ins while it loads (and
    only then), so the module runs with pydantic alone."""
    return wheel_module(PROTOCOL_MEMBER, PROTOCOL_MODULE)


# --- other modules of the wheel, loaded with their sglang imports stubbed ---------------------


def wheel_module(member: str, name: str) -> ModuleType:
    """One module of the wheel (say `sglang/srt/sampling/sampling_params.py`), extracted once
    and loaded under `name`; its imports of sglang, openai and xgrammar get stand-ins (only
    while it loads), so its own logic runs without torch."""
    return _wheel_module(member, name)


@functools.cache
def _wheel_module(member: str, name: str) -> ModuleType:
    target = _extracted(
        member, CACHE_DIR / f"{name}-{SGLANG_VERSION}.py", CACHE_DIR, SGLANG_VERSION
    )
    finder = _StubFinder()
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in _STUBBED_PACKAGES}
    sys.meta_path.insert(0, finder)
    try:
        spec = importlib.util.spec_from_file_location(name, target)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"cannot load {target}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        sys.meta_path.remove(finder)
        for stubbed in [k for k in sys.modules if k.split(".")[0] in _STUBBED_PACKAGES]:
            if stubbed not in saved:
                del sys.modules[stubbed]
    return module
