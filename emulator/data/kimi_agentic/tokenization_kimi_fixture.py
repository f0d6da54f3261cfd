"""A Kimi-K2.5-shaped custom-code tokenizer: tiktoken BPE behind a transformers PreTrainedTokenizer.

Loaded with `trust_remote_code` through `auto_map`; renders tools with the folder's helper module.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import regex
import tiktoken
from transformers import PreTrainedTokenizer

from .tool_declaration_ts import encode_tools_to_typescript_style

# GPT-4-style pre-tokenization: words, numbers of up to three digits, punctuation, spaces.
PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256


def _byte_alphabet() -> dict[int, str]:
    """Every byte as one printable character, so tokens are strings (GPT-2's mapping)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def load_ranks(path: str) -> dict[bytes, int]:
    """The tiktoken BPE file: one `base64(token bytes) rank` per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as stream:
        for line in stream.read().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def python_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's merge rule in plain Python: merge the adjacent pair of lowest rank first."""
    whole = ranks.get(piece)
    if whole is not None:
        return [whole]
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best):
                best, at = rank, i
        if best is None:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return [ranks[part] for part in parts]


class KimiFixtureTokenizer(PreTrainedTokenizer):
    """Ordinary ids from a tiktoken BPE file, 256 special ids after Kimi's 163,584 ordinary ones.

    `pure_python_bpe` (tokenizer_config.json) encodes with `python_bpe` instead of tiktoken:
    the same ids, the speed of a pure-Python tokenizer.
    """

    vocab_files_names = {"vocab_file": "tiktoken.model"}  # noqa: RUF012 (transformers' own)
    model_input_names = ["input_ids", "attention_mask"]  # noqa: RUF012

    def __init__(
        self,
        vocab_file: str,
        special_base_id: int = 163584,
        special_names: dict[str, str] | None = None,
        pure_python_bpe: bool = False,
        **kwargs: Any,
    ) -> None:
        self.vocab_file = vocab_file
        self.pure_python_bpe = pure_python_bpe
        self._ranks = load_ranks(vocab_file)
        names = {int(k): v for k, v in (special_names or {}).items()}
        self._specials = {
            names.get(i, f"<|reserved_token_{i - special_base_id}|>"): i
            for i in range(special_base_id, special_base_id + NUM_SPECIAL_TOKENS)
        }
        self._model = tiktoken.Encoding(
            name=os.path.basename(vocab_file),
            pat_str=PAT_STR,
            mergeable_ranks=self._ranks,
            special_tokens=self._specials,
        )
        self._pattern = regex.compile(PAT_STR)
        alphabet = _byte_alphabet()
        self._byte_of = {char: b for b, char in alphabet.items()}
        self._token_of = {
            rank: "".join(alphabet[b] for b in token) for token, rank in self._ranks.items()
        }
        self._id_of = {token: rank for rank, token in self._token_of.items()}
        self._special_base_id = special_base_id
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]

    @property
    def vocab_size(self) -> int:
        return self._special_base_id + NUM_SPECIAL_TOKENS

    def get_vocab(self) -> dict[str, int]:
        return {**self._id_of, **self._specials}

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of text with no special tokens in it."""
        if not self.pure_python_bpe:
            return list(self._model.encode_ordinary(text))
        ids: list[int] = []
        for piece in self._pattern.findall(text):
            ids.extend(python_bpe(piece.encode("utf-8"), self._ranks))
        return ids

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [self._token_of[i] for i in self.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        found = self._id_of.get(token)
        return found if found is not None else self._specials[token]

    def _convert_id_to_token(self, index: int) -> str:
        token = self._token_of.get(index)
        if token is not None:
            return token
        for name, special in self._specials.items():
            if special == index:
                return name
        raise KeyError(f"no token has id {index}")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out: list[str] = []
        pending = bytearray()
        for token in tokens:
            if token in self._specials:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                out.append(token)
            else:
                pending.extend(self._byte_of[char] for char in token)
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(  # type: ignore[override]
        self, conversation: Any, tools: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> Any:
        """As transformers', with the tools also given to the template as TypeScript-style
        declarations (`tools_ts_str`), rendered by the folder's `tool_declaration_ts` module."""
        if tools:
            kwargs["tools_ts_str"] = encode_tools_to_typescript_style(tools)
        return super().apply_chat_template(conversation, tools=tools, **kwargs)  # type: ignore[arg-type]

    def save_vocabulary(
        self, save_directory: str, filename_prefix: str | None = None
    ) -> tuple[str]:
        name = (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model"
        target = os.path.join(save_directory, name)
        with open(target, "wb") as stream:
            for token, rank in sorted(self._ranks.items(), key=lambda item: item[1]):
                stream.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
        return (target,)
