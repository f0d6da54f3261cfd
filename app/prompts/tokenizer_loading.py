"""Loading a tokenizer folder as SGLang 0.5.23's `get_tokenizer` does, then checking it is faithful.

transformers 5 rebuilds parts of some tokenizers after reading their files; SGLang undoes that
after `from_pretrained` (`sglang/srt/utils/hf_transformers/tokenizer.py`), and so does this:

- A folder that loads as the generic `TokenizersBackend` (its model type maps to no class) is
  loaded again without the fast path, then as the class `tokenizer_config.json` declares.
- A class whose `__init__` builds its own pre-tokenizer (a `LlamaTokenizerFast` over the
  ByteLevel `tokenizer.json` DeepSeek-V3 ships gets Metaspace under transformers 5.19) gets the
  pre-tokenizer and decoder of `tokenizer.json` back.
- `add_bos_token` / `add_eos_token`, which transformers 5 drops when a `tokenizer.json` exists,
  are restored from `tokenizer_config.json` for the classes that had them in transformers 4
  (Llama, CodeLlama, Gemma, Cohere), with transformers 4's defaults (BOS on, EOS off; EOS always
  off for a fast tokenizer).
- A `special_tokens_pattern` of "cls_sep" on a tokenizer with no CLS or SEP token becomes "none"
  (it would put None into the ids).

Then `check_faithful` compares the pre-tokenizer and normalizer in use with the ones
`tokenizer.json` declares: a folder whose tokenizer still differs is refused, naming both. A
model type whose class transformers forces (qwen3_5's `Qwen3_5Tokenizer`, NFC) gets that class's
normalizer at the server too, so its normalizer is what SGLang's loader ends up with.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from app.core.errors import TokenizerError
from app.prompts.transformers_pin import imported_transformers

logger = logging.getLogger(__name__)

# transformers 5's class for a model type with no tokenizer mapping
_GENERIC_CLASS = "TokenizersBackend"
# the classes whose add_bos_token / add_eos_token transformers 4 honoured, and its defaults
_BOS_EOS_CLASSES = frozenset(
    {
        "LlamaTokenizer",
        "LlamaTokenizerFast",
        "CodeLlamaTokenizer",
        "CodeLlamaTokenizerFast",
        "GemmaTokenizer",
        "GemmaTokenizerFast",
        "CohereTokenizerFast",
    }
)
_V4_DEFAULTS = {"add_bos_token": True, "add_eos_token": False}
# base classes that cannot stand for a tokenizer of their own
_BASE_CLASSES = ("PreTrainedTokenizer", "PreTrainedTokenizerBase")
# one load at a time per process: transformers imports its classes on first use, also inside
# from_pretrained, and a thread reaching a class another thread is importing fails to import
# it (transformers itself is first imported through imported_transformers, for the same reason)
_LOAD_LOCK = threading.Lock()
# the components check_faithful compares, and the rest of a tokenizer.json that carries only
# them (an empty vocabulary: the check never builds the declared model)
_CHECKED_PARTS = ("pre_tokenizer", "normalizer")
_UNK = "[UNK]"
_EMPTY_TOKENIZER: dict[str, Any] = {
    "version": "1.0",
    "added_tokens": [],
    "model": {"type": "WordLevel", "vocab": {}, "unk_token": _UNK},
}


def load_as_sglang(folder: Path, *, trust_remote_code: bool) -> Any:
    """The transformers tokenizer of folder, loaded and fixed as SGLang's get_tokenizer does
    (one load at a time in a process)."""
    with _LOAD_LOCK:
        return _load_as_sglang(folder, trust_remote_code=trust_remote_code)


def _load_as_sglang(folder: Path, *, trust_remote_code: bool) -> Any:
    imported_transformers()
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {
        "trust_remote_code": trust_remote_code,
        "clean_up_tokenization_spaces": False,
        "use_fast": True,
        "local_files_only": True,
    }
    tokenizer = AutoTokenizer.from_pretrained(str(folder), **kwargs)
    if type(tokenizer).__name__ == _GENERIC_CLASS:
        kwargs["use_fast"] = False
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **kwargs)
        if type(tokenizer).__name__ == _GENERIC_CLASS:
            tokenizer = _declared_class(folder, kwargs) or tokenizer
    restore_declared_components(tokenizer, folder)
    restore_bos_eos_flags(tokenizer, folder)
    fix_special_tokens_pattern(tokenizer)
    return tokenizer


def _config(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _declared_class(folder: Path, kwargs: dict[str, Any]) -> Any:
    """The tokenizer loaded as the class tokenizer_config.json names, or None."""
    transformers = imported_transformers()
    name = _config(folder).get("tokenizer_class")
    if not isinstance(name, str) or not name or name in _BASE_CLASSES:
        return None
    cls = getattr(transformers, name, None)
    if cls is None:
        return None
    try:
        return cls.from_pretrained(str(folder), **kwargs)
    except (OSError, ValueError, TypeError, ImportError) as exc:
        logger.warning(
            "loading %s as its declared %s failed: %s",
            folder,
            name,
            exc,
            extra={"action": "tokenizer_fallback"},
        )
        return None


def _declared(folder: Path) -> Any | None:
    """The raw tokenizers.Tokenizer of folder/tokenizer.json, or None without one."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the loader itself read it, so this is the check's own failure
        raise TokenizerError(f"cannot read {file} to check the tokenizer: {exc}") from exc


def _declared_parts(folder: Path) -> dict[str, Any] | None:
    """tokenizer.json's pre-tokenizer and normalizer as the tokenizers library writes them back
    (its defaults filled in), or None without the file; the vocabulary is not built."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        declared = json.loads(file.read_text(encoding="utf-8"))
        parts = {part: declared.get(part) for part in _CHECKED_PARTS}
        raw = Tokenizer.from_str(json.dumps({**_EMPTY_TOKENIZER, **parts}))
        return _parts_json(raw.pre_tokenizer, raw.normalizer)
    except Exception as exc:  # the loader itself read it, so this is the check's own failure
        raise TokenizerError(f"cannot read {file} to check the tokenizer: {exc}") from exc


def _parts_json(pre_tokenizer: Any, normalizer: Any) -> dict[str, Any]:
    """The JSON of a pre-tokenizer and a normalizer, as a tokenizer holding only them writes it."""
    from tokenizers import Tokenizer, models

    holder = Tokenizer(models.WordLevel({}, unk_token=_UNK))
    holder.pre_tokenizer = pre_tokenizer
    holder.normalizer = normalizer
    written: dict[str, Any] = json.loads(holder.to_str())
    return {part: written.get(part) for part in _CHECKED_PARTS}


def restore_declared_components(tokenizer: Any, folder: Path) -> None:
    """tokenizer.json's pre-tokenizer and decoder, where the class replaced the pre-tokenizer
    with one of another kind."""
    backend: Any = getattr(tokenizer, "_tokenizer", None)
    raw: Any = _declared(folder) if backend is not None else None
    if raw is None or raw.pre_tokenizer is None or backend.pre_tokenizer is None:
        return
    declared, loaded = type(raw.pre_tokenizer).__name__, type(backend.pre_tokenizer).__name__
    if declared != loaded:
        logger.info(
            "tokenizer %s: pre-tokenizer %s restored to tokenizer.json's %s",
            folder,
            loaded,
            declared,
            extra={"action": "pre_tokenizer_restored"},
        )
        backend.pre_tokenizer = raw.pre_tokenizer
        backend.decoder = raw.decoder


def restore_bos_eos_flags(tokenizer: Any, folder: Path) -> None:
    """add_bos_token / add_eos_token as tokenizer_config.json (or transformers 4) set them."""
    imported_transformers()
    from transformers import PreTrainedTokenizerFast

    config = _config(folder)
    if config.get("tokenizer_class", "") not in _BOS_EOS_CLASSES:
        return
    changed = False
    for attr, default in _V4_DEFAULTS.items():
        wanted = config.get(attr)
        if wanted is None:
            wanted = default
        if attr == "add_eos_token" and isinstance(tokenizer, PreTrainedTokenizerFast):
            wanted = False  # a fast tokenizer's EOS came from tokenizer.json, not the flag
        if getattr(tokenizer, attr, None) != wanted:
            # the public names are properties over these attributes
            setattr(tokenizer, f"_{attr}", wanted)
            changed = True
    if changed and hasattr(tokenizer, "update_post_processor"):
        tokenizer.update_post_processor()


def fix_special_tokens_pattern(tokenizer: Any) -> None:
    """ "cls_sep" without a CLS or SEP token would insert None ids: use "none"."""
    if getattr(tokenizer, "special_tokens_pattern", None) == "cls_sep" and (
        tokenizer.cls_token_id is None or tokenizer.sep_token_id is None
    ):
        tokenizer.special_tokens_pattern = "none"


def check_faithful(tokenizer: Any, folder: Path) -> None:
    """TokenizerError when the pre-tokenizer or normalizer in use is not tokenizer.json's."""
    backend: Any = getattr(tokenizer, "_tokenizer", None)
    declared_json = _declared_parts(folder) if backend is not None else None
    if declared_json is None:
        return
    loaded_json = _parts_json(backend.pre_tokenizer, backend.normalizer)
    forced = class_forced_by_model_type(folder)
    for part in _CHECKED_PARTS:
        declared, loaded = _effective(declared_json.get(part)), _effective(loaded_json.get(part))
        if declared == loaded:
            continue
        if part == "normalizer" and forced is not None:
            # transformers builds this class for the model type on the server too, and
            # SGLang's get_tokenizer restores only the pre-tokenizer and decoder: the server
            # ends up with the same normalizer, so the ids agree
            logger.info(
                "tokenizer %s: normalizer %s of %s (forced for model type %s), as at the server",
                folder,
                _kind(loaded),
                type(tokenizer).__name__,
                forced,
                extra={"action": "normalizer_forced"},
            )
            continue
        raise TokenizerError(
            f"the tokenizer in {str(folder)!r} loads ({type(tokenizer).__name__}) with a "
            f"{part} that is not the one its tokenizer.json declares (declared "
            f"{_kind(declared)}, in use {_kind(loaded)}): its prompts would not be the "
            f"server's; {_advice(folder, tokenizer)}"
        )


def class_forced_by_model_type(folder: Path) -> str | None:
    """The model type of config.json when transformers builds its own tokenizer class for it
    whatever tokenizer_config.json declares (its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
    as SGLang's server does too), else None."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        return None
    imported_transformers()
    from transformers.models.auto import tokenization_auto

    forced: set[str] = getattr(
        tokenization_auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", set()
    )
    return model_type if model_type in forced else None


def _advice(folder: Path, tokenizer: Any) -> str:
    """A fix that works: the declared class when it is what was loaded, else the server."""
    if _config(folder).get("tokenizer_class") == type(tokenizer).__name__:
        return (
            "its tokenizer_config.json declares this class: fix tokenizer_class, or build the "
            "prompts on the server with --render-with URL"
        )
    return (
        "the class does not come from tokenizer_config.json's tokenizer_class, so build the "
        "prompts on the server with --render-with URL"
    )


def _effective(component: Any) -> Any:
    """A component's JSON, a Sequence of none being none (both leave the text as it is)."""
    if isinstance(component, dict) and component.get("type") == "Sequence":
        inner = component.get("normalizers", component.get("pretokenizers"))
        if inner == []:
            return None
    return component


def _kind(component: Any) -> str:
    if component is None:
        return "none"
    if isinstance(component, dict):
        return str(component.get("type", "?"))
    return type(component).__name__
