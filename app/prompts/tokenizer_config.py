"""What a tokenizer folder says about itself, read from its config files and its vocabulary:
custom code class, eos ids, context length, one-token tag ids and the default chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Beyond this, model_max_length is transformers' "no limit" placeholder (about 1e30).
_SANE_MAX_LENGTH = 10**8


def custom_code_class(folder: Path) -> str | None:
    """The `auto_map` entry naming the folder's own tokenizer class, if it has one."""
    config = _read_json(folder / "tokenizer_config.json") or {}
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict):
        return None
    entry = auto_map.get("AutoTokenizer")
    if isinstance(entry, list):
        entry = next((e for e in entry if isinstance(e, str)), None)
    return entry if isinstance(entry, str) else None


def default_template(template: Any) -> str | None:
    """The template text SGLang reads for the content format: the "default" one of several."""
    if isinstance(template, str):
        return template
    if isinstance(template, dict):
        chosen = template.get("default")
        return chosen if isinstance(chosen, str) else None
    if isinstance(template, list):  # [{"name", "template"}, ...] as tokenizer_config holds it
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def single_token_id(tokenizer: Any, text: str) -> int | None:
    added = tokenizer.get_added_vocab()
    token_id = added.get(text)
    if token_id is None:
        return None
    # An added token is matched before the model splits text, so it stays one id in context.
    if tokenizer.encode(text, add_special_tokens=False) != [token_id]:
        return None
    return int(token_id)


def _read_json(file: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def eos_token_ids_of(tokenizer: Any, folder: Path) -> list[int]:
    found: list[int] = []
    if isinstance(tokenizer.eos_token_id, int):
        found.append(tokenizer.eos_token_id)
    generation = _read_json(folder / "generation_config.json") or {}
    extra = generation.get("eos_token_id")
    for value in extra if isinstance(extra, list) else [extra]:
        if isinstance(value, int) and not isinstance(value, bool) and value not in found:
            found.append(value)
    return found


def renders_with_dsv32_encoder(folder: Path, has_chat_template: bool) -> bool:
    """Whether SGLang 0.5.23 renders this folder with its DeepSeek-V3.2 encoder (`encoding_dsv32`,
    chosen by `chat_encoding.resolve_chat_encoding_spec`): a DeepseekV3 architecture (V3.2's
    `DeepseekV32ForCausalLM` among them) with no chat template, and none of the encoders its
    rules take first (V4.1, V4, Kimi-K3, Inkling)."""
    config = _read_json(folder / "config.json") or {}
    architectures = config.get("architectures")
    arch = architectures[0] if isinstance(architectures, list) and architectures else ""
    arch = arch if isinstance(arch, str) else ""
    if config.get("model_type") == "deepseek_v41" or any(
        name in arch for name in ("DeepseekV41", "DeepseekV4", "KimiK3", "Inkling")
    ):
        return False
    return "DeepseekV3" in arch and not has_chat_template


def context_length_of(tokenizer: Any, folder: Path) -> int | None:
    config = _read_json(folder / "config.json") or {}
    # Multimodal models (Kimi-K2.5 among them) keep the language model's limits in text_config.
    for section in (config, config.get("text_config"), config.get("language_config")):
        if not isinstance(section, dict):
            continue
        for key in ("max_position_embeddings", "max_seq_len", "seq_length"):
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < _SANE_MAX_LENGTH:
        return limit
    return None
