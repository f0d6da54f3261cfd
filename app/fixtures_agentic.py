"""A Kimi-K2.5-shaped custom-code tokenizer folder built offline, for agentic tests and benches.

tiktoken BPE behind a PreTrainedTokenizer, a tool-declaration helper module, a tools template.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

from app.fixtures import (
    BOS,
    CONTEXT_LENGTH,
    EOS,
    IM_END,
    PAD,
    SPECIAL_BASE_ID,
    SPECIAL_COUNT,
    SPECIAL_TOKENS,
    SPECIAL_TOKENS_BY_NAME,
    ensure_built,
    fixture_version,
    ordinary_token_bytes,
)

logger = logging.getLogger(__name__)

AGENTIC_FIXTURE_NAME = "kimi-k2.5-agentic-fixture"
SLOW_FIXTURE_NAME = "kimi-k2.5-agentic-slow-fixture"
TOKENIZER_MODULE = "tokenization_kimi_fixture.py"
HELPER_MODULE = "tool_declaration_ts.py"
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CLASS = "KimiFixtureTokenizer"
# the files copied verbatim from app/data/kimi_agentic into the folder
_SOURCES = (TOKENIZER_MODULE, HELPER_MODULE, TEMPLATE_FILE)


def _source(name: str) -> bytes:
    return resources.files("app").joinpath(f"data/kimi_agentic/{name}").read_bytes()


def chat_template() -> str:
    """The fixture's chat template text (chat_template.jinja)."""
    return _source(TEMPLATE_FILE).decode("utf-8")


def _vocab_file() -> bytes:
    lines = [
        base64.b64encode(token) + b" " + str(rank).encode()
        for rank, token in enumerate(ordinary_token_bytes())
    ]
    return b"\n".join(lines) + b"\n"


def _special_token(token_id: int) -> str:
    return SPECIAL_TOKENS.get(token_id, f"<|reserved_token_{token_id - SPECIAL_BASE_ID}|>")


def _tokenizer_config(*, slow: bool) -> dict[str, Any]:
    ids = range(SPECIAL_BASE_ID, SPECIAL_BASE_ID + SPECIAL_COUNT)
    added = {
        str(i): {
            "content": _special_token(i),
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i in ids
    }
    return {
        "auto_map": {"AutoTokenizer": [f"{TOKENIZER_MODULE[:-3]}.{TOKENIZER_CLASS}", None]},
        "tokenizer_class": TOKENIZER_CLASS,
        "special_base_id": SPECIAL_BASE_ID,
        "special_names": {str(i): name for i, name in SPECIAL_TOKENS.items()},
        "pure_python_bpe": slow,
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT_LENGTH,
        "added_tokens_decoder": added,
    }


def _files(*, slow: bool) -> dict[str, bytes]:
    def dump(value: Any) -> bytes:
        return (json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()

    config = {
        "architectures": ["KimiK25FixtureForCausalLM"],
        "bos_token_id": SPECIAL_TOKENS_BY_NAME[BOS],
        "eos_token_id": SPECIAL_TOKENS_BY_NAME[EOS],
        "max_position_embeddings": CONTEXT_LENGTH,
        "vocab_size": SPECIAL_BASE_ID + SPECIAL_COUNT,
    }
    generation = {"eos_token_id": SPECIAL_TOKENS_BY_NAME[IM_END], "max_length": CONTEXT_LENGTH}
    files = {name: _source(name) for name in _SOURCES}
    files |= {
        "tiktoken.model": _vocab_file(),
        "tokenizer_config.json": dump(_tokenizer_config(slow=slow)),
        "special_tokens_map.json": dump({"bos_token": BOS, "eos_token": IM_END, "pad_token": PAD}),
        "config.json": dump(config),
        "generation_config.json": dump(generation),
    }
    return files


def build_agentic_tokenizer(out_dir: Path, *, slow: bool = False) -> Path:
    """Write the custom-code fixture folder into out_dir (created if needed) and return it.

    Load it with `AutoTokenizer.from_pretrained(out_dir, trust_remote_code=True)`. slow: the
    same ids, encoded by a pure-Python BPE instead of tiktoken.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in _files(slow=slow).items():
        (out_dir / name).write_bytes(data)
    logger.debug("wrote the agentic fixture tokenizer to %s", out_dir)
    return out_dir


def agentic_fixture_version() -> str:
    """Changes whenever this builder, its sources or the plain fixture's vocabulary change."""
    digest = hashlib.sha256(fixture_version().encode())
    digest.update(Path(__file__).read_bytes())
    for name in _SOURCES:
        digest.update(_source(name))
    return digest.hexdigest()[:16]


def ensure_agentic_tokenizer(cache_dir: Path, *, slow: bool = False) -> Path:
    """The custom-code fixture in cache_dir, built once and rebuilt when the builder changes."""
    name = SLOW_FIXTURE_NAME if slow else AGENTIC_FIXTURE_NAME
    return ensure_built(
        Path(cache_dir),
        name,
        agentic_fixture_version(),
        lambda out: build_agentic_tokenizer(out, slow=slow),
    )
