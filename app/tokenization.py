"""Client-side chat templating: local tokenizer loading, prompt ids, hashes, reasoning split.

transformers is imported lazily inside functions, so importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from app.contracts import Message
from app.errors import InputError, TokenizerError

logger = logging.getLogger(__name__)

THINK_START = "<think>"
THINK_END = "</think>"
# Beyond this, model_max_length is transformers' "no limit" placeholder (about 1e30).
_SANE_MAX_LENGTH = 10**8

# Files whose bytes decide the ids a tokenizer produces; tokenization_*.py is the code of
# trust_remote_code tokenizers (Kimi's own tokenizer is one).
_HASHED_NAMES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
    }
)
_HASHED_SUFFIXES = (".model", ".tiktoken")

# apply_chat_template arguments tokenmill sets itself; a template kwarg with one of these
# names would change what is produced (or clash with the call), so it is refused.
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class _NoTorchAdvice(logging.Filter):
    """tokenmill needs only tokenizers: transformers' "PyTorch was not found" line is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PyTorch was not found" not in record.getMessage()


def quiet_transformers() -> None:
    """Drop transformers' no-PyTorch advice, which it logs once, when `transformers` is first
    imported. Called at process start (CLI, workers) as well as before loading a tokenizer, so
    it holds whichever import comes first; every other transformers record passes."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchAdvice) for f in logger.filters):
        logger.addFilter(_NoTorchAdvice())


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> ChatTokenizer:
    """Load a tokenizer from a local folder (never the hub) and check it has a chat template."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise TokenizerError(f"tokenizer path {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise TokenizerError(f"tokenizer path {str(folder)!r} is not a folder")
    try:
        quiet_transformers()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        raise TokenizerError(f"could not load the tokenizer in {str(folder)!r}: {exc}") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerError(
            f"the tokenizer in {str(folder)!r} has no chat template "
            "(no chat_template in tokenizer_config.json and no chat_template.jinja)"
        )
    chat = ChatTokenizer(tokenizer, folder)
    logger.info(
        "loaded tokenizer %s (tokenizer %s, template %s)",
        folder,
        chat.tokenizer_hash[:12],
        chat.chat_template_hash[:12],
    )
    return chat


class ChatTokenizer:
    """A Hugging Face tokenizer with its chat template, as the producer and exporter use it.

    `apply` gives exactly the ids of `apply_chat_template(messages, add_generation_prompt=True)`.
    """

    def __init__(self, tokenizer: Any, path: Path) -> None:
        self._tokenizer = tokenizer
        self._path = path
        self._tokenizer_hash = tokenizer_files_hash(path)
        template = tokenizer.chat_template
        text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
        self._chat_template_hash = hashlib.sha256(text.encode("utf-8")).hexdigest()
        self._think_start_id = _single_token_id(tokenizer, THINK_START)
        self._think_end_id = _single_token_id(tokenizer, THINK_END)
        self._eos_token_ids = _eos_token_ids(tokenizer, path)
        self._context_length = _context_length(tokenizer, path)

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped transformers tokenizer."""
        return self._tokenizer

    @property
    def path(self) -> Path:
        return self._path

    @property
    def tokenizer_hash(self) -> str:
        """sha256 over the names and contents of the tokenizer files in the folder."""
        return self._tokenizer_hash

    @property
    def chat_template_hash(self) -> str:
        """sha256 of the chat template text (of the JSON of all named templates, if several)."""
        return self._chat_template_hash

    @property
    def think_start_id(self) -> int | None:
        return self._think_start_id

    @property
    def think_end_id(self) -> int | None:
        """Id of `</think>` when it is one added/special token, else None."""
        return self._think_end_id

    @property
    def eos_token_ids(self) -> list[int]:
        """The tokenizer's eos id, then any from generation_config.json, without repeats."""
        return list(self._eos_token_ids)

    @property
    def context_length(self) -> int | None:
        return self._context_length

    def render(
        self, messages: Sequence[Message], chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> str:
        """The prompt text the template makes, generation prompt included."""
        kwargs = _template_kwargs(chat_template_kwargs)
        try:
            text = self._tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception as exc:
            raise InputError(f"chat template failed: {exc}") from exc
        return str(text)

    def apply(
        self, messages: Sequence[Message], chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Prompt ids, as `apply_chat_template(messages, add_generation_prompt=True)` gives them."""
        kwargs = _template_kwargs(chat_template_kwargs)
        try:
            result = self._tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=True, **kwargs
            )
        except Exception as exc:
            raise InputError(f"chat template failed: {exc}") from exc
        return _ids_of(result)

    def apply_batch(
        self,
        conversations: Sequence[Sequence[Message]],
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[list[int]]:
        """`apply` for many conversations in one call: the same ids, about twice as fast.

        apply_chat_template on a list of conversations renders each one, then encodes all
        texts in one batched call of the fast tokenizer (on all cores), exactly as it encodes a
        single one (add_special_tokens=False). If the template fails on a conversation, the
        InputError names its index in the batch; `apply` them one by one to keep the others.
        """
        if not conversations:
            return []
        batch = [list(conversation) for conversation in conversations]
        kwargs = _template_kwargs(chat_template_kwargs)
        try:
            result = self._tokenizer.apply_chat_template(
                batch, add_generation_prompt=True, tokenize=True, **kwargs
            )
        except Exception as exc:
            raise _batch_error(self._tokenizer, batch, kwargs, exc) from exc
        rows = result if isinstance(result, list) else result["input_ids"]
        return [[int(i) for i in ids] for ids in rows]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def split_reasoning(
    output_ids: Sequence[int], think_end_id: int | None, *, think_start_id: int | None = None
) -> tuple[list[int] | None, list[int]]:
    """Split generated ids at the FIRST `</think>` id: (reasoning, answer), the tag in neither.

    The first one, because the model closes its reasoning once; a later `</think>` id belongs
    to the answer. With no `</think>` id (or think_end_id None) the result is (None, all ids):
    the caller decides what an unterminated reasoning means. If think_start_id is given and
    the output begins with it (models whose template does not supply `<think>`), it is dropped
    from the reasoning. Trailing eos ids stay in the answer. Never a string search.
    """
    ids = list(output_ids)
    if think_end_id is None:
        return None, ids
    try:
        end = ids.index(think_end_id)
    except ValueError:
        return None, ids
    reasoning = ids[:end]
    if think_start_id is not None and reasoning[:1] == [think_start_id]:
        reasoning = reasoning[1:]
    return reasoning, ids[end + 1 :]


def tokenizer_files_hash(folder: Path) -> str:
    """sha256 over (name, sha256 of content) of each tokenizer file in folder, sorted by name."""
    digest = hashlib.sha256()
    for file in sorted(folder.iterdir(), key=lambda p: p.name):
        if not file.is_file() or not _is_tokenizer_file(file.name):
            continue
        digest.update(file.name.encode("utf-8") + b"\0")
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def _is_tokenizer_file(name: str) -> bool:
    if name in _HASHED_NAMES or name.endswith(_HASHED_SUFFIXES):
        return True
    return name.startswith("tokenization_") and name.endswith(".py")


def _template_kwargs(chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping):
        raise TokenizerError(
            "chat template kwargs must be a JSON object (a dict) such as "
            f'{{"thinking": false}}, not {type(chat_template_kwargs).__name__}'
        )
    kwargs = dict(chat_template_kwargs)
    for key in kwargs:
        if not isinstance(key, str):
            raise TokenizerError(f"chat template kwarg names must be strings, not {key!r}")
        if key in _RESERVED_KWARGS:
            raise TokenizerError(
                f"chat template kwarg {key!r} is not allowed: tokenmill sets it itself"
            )
    return kwargs


def _batch_error(
    tokenizer: Any, batch: list[list[Message]], kwargs: dict[str, Any], exc: Exception
) -> InputError:
    """The error of the first conversation the template fails on, else of the whole batch."""
    for index, conversation in enumerate(batch):
        try:
            tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception as item_exc:
            return InputError(
                f"chat template failed on conversation {index} of the batch: {item_exc}"
            )
    return InputError(f"chat template failed: {exc}")


def _ids_of(result: Any) -> list[int]:
    """Ids from apply_chat_template: a BatchEncoding in transformers 5, a list in 4."""
    ids = result if isinstance(result, list) else result["input_ids"]
    return [int(i) for i in ids]


def _single_token_id(tokenizer: Any, text: str) -> int | None:
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


def _eos_token_ids(tokenizer: Any, folder: Path) -> list[int]:
    found: list[int] = []
    if isinstance(tokenizer.eos_token_id, int):
        found.append(tokenizer.eos_token_id)
    generation = _read_json(folder / "generation_config.json") or {}
    extra = generation.get("eos_token_id")
    for value in extra if isinstance(extra, list) else [extra]:
        if isinstance(value, int) and not isinstance(value, bool) and value not in found:
            found.append(value)
    return found


def _context_length(tokenizer: Any, folder: Path) -> int | None:
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
