"""Stand-ins for the GPU stack SGLang's server process imports but, without a model, never runs.

`install()` puts a finder first on `sys.meta_path` that answers every import of a STUBBED
package (torch, triton, flashinfer, the kernels, the model-side parsers) with a StubModule:
its attributes are submodules (lower-case names: `torch.cuda`, `torch.float16`), classes
(capitalised names: `torch.Tensor`, `nn.Module`, which subclass, `isinstance` and pickle
cleanly) or, called, the permissive `Anything`. MODULE_FACTS pins the few values SGLang
branches on (no CUDA, no HIP: its CPU platform), ABSENT the devices it probes with hasattr.
Everything SGLang's HTTP server, TokenizerManager and DetokenizerManager compute runs as the
wheel ships it.
"""

from __future__ import annotations

import abc
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

STUBBED = (
    "torch", "torchvision", "torchaudio", "triton", "triton_kernels", "sgl_kernel",
    "flashinfer", "vllm", "xgrammar", "outlines", "llguidance", "cuda", "nvidia", "pynvml",
    "deep_gemm", "tilelang", "torch_memory_saver", "quack", "humming", "kernels",
    "mistral_common", "openai_harmony", "compressed_tensors", "gguf", "numba", "decord", "av",
    "soundfile", "timm", "modelscope", "sentencepiece", "IPython", "interegular", "blobfile",
    "anthropic", "openai", "smg_grpc_servicer", "grpc", "tml_renderers", "deepseek_recipe",
    "apache_tvm_ffi", "tvm_ffi", "cutlass", "flash_attn", "sgl_deep_ep", "deep_ep", "flash_mla",
    "scipy", "watchfiles", "zstandard", "einops",
)  # fmt: skip
# attribute values read as strings (a library's name, triton's backend: "cpu")
NAMED: dict[str, str] = {"name": "stub", "backend": "cpu"}
# torch's devices SGLang looks for with hasattr: none of them is here
ABSENT = frozenset({"npu", "hpu", "xpu", "mlu", "musa", "sail", "mps"})
TORCH_VERSION = "2.14.1"


def _false(*args: Any, **kwargs: Any) -> bool:
    return False


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


MODULE_FACTS: dict[str, dict[str, Any]] = {
    "torch": {"__version__": TORCH_VERSION},
    "torch.version": {"cuda": None, "hip": None, "musa": None, "git_version": "stub"},
    "torch.cuda": {"is_available": _false, "device_count": _zero},
}


class _Permissive:
    """Answers calls, indexing, arithmetic, comparisons and `with` with Anything; a call with
    one callable is a decorator and returns it."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return Anything

    def __getitem__(self, item: Any) -> Any:
        return Anything

    def __or__(self, other: Any) -> Any:
        return Anything

    __ror__ = __or__

    def __iter__(self) -> Any:
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __instancecheck__(self, obj: Any) -> bool:
        return False

    def __subclasscheck__(self, cls: Any) -> bool:
        return False

    def __int__(self) -> int:
        return 0

    __index__ = __len__ = __int__

    def __float__(self) -> float:
        return 0.0

    def __contains__(self, item: Any) -> bool:
        return False

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def __lt__(self, other: Any) -> bool:
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return other is self

    def _anything(self, *other: Any) -> Any:
        return Anything

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _anything
    __truediv__ = __floordiv__ = __mod__ = __pow__ = __matmul__ = _anything
    __neg__ = __invert__ = __and__ = __rand__ = __xor__ = _anything

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.any_schema()


class _Any(_Permissive):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return NAMED.get(name, self)

    def __mro_entries__(self, bases: Any) -> tuple[type, ...]:
        return (_Base,)

    def __repr__(self) -> str:
        return "<stub>"

    __str__ = __repr__

    def __reduce__(self) -> str:
        return "Anything"

    def __deepcopy__(self, memo: Any) -> Any:
        return self

    def __copy__(self) -> Any:
        return self


Anything = _Any()


class _Meta(abc.ABCMeta):
    """The stub classes' type: an ABCMeta, so `class X(nn.Module, ABC)` has one metaclass."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return NAMED.get(name, Anything)

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return Anything

    __ror__ = __or__


class _Base(metaclass=_Meta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass

    __call__ = _Permissive.__call__
    __enter__ = _Permissive.__enter__
    __exit__ = _Permissive.__exit__

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Anything

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.any_schema()


_classes: dict[str, type] = {}


class StubModule(types.ModuleType, _Permissive):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if self.__name__ == "torch" and name in ABSENT:
            raise AttributeError(name)
        if name in NAMED:
            return NAMED[name]
        if name.lstrip("_")[:1].isupper():
            key = f"{self.__name__}.{name}"
            if key not in _classes:
                _classes[key] = _Meta(name, (_Base,), {"__module__": self.__name__})
            return _classes[key]
        return importlib.import_module(f"{self.__name__}.{name}")

    def __repr__(self) -> str:
        return f"<stub module {self.__name__}>"

    def __reduce__(self) -> Any:
        return (importlib.import_module, (self.__name__,))

    def __deepcopy__(self, memo: Any) -> Any:
        return self

    def __copy__(self) -> Any:
        return self

    __hash__ = object.__hash__
    __eq__ = object.__eq__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = StubModule(spec.name)
        module.__path__ = []
        module.__version__ = TORCH_VERSION if spec.name == "torch" else "0.26.0"  # type: ignore[attr-defined]
        for key, value in MODULE_FACTS.get(spec.name, {}).items():
            setattr(module, key, value)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


_FINDER = _Finder()


def install() -> None:
    """Stub the GPU stack for every later import (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    # transformers' Llama modelling would be built from stand-ins: SGLang's compat patch
    # for it takes the ImportError and skips it, as on a machine without torch
    sys.modules.setdefault("transformers.models.llama.modeling_llama", None)  # type: ignore[arg-type]
