"""A small Kimi-K2.5-shaped tokenizer built offline, for the demo, the tests and the emulator.

Byte-level BPE with 2,000 ordinary ids and the special tokens on Kimi-K2.5's real ids.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FIXTURE_NAME = "kimi-k2.5-fixture"
# Ordinary (byte + merged) tokens take ids [0, ORDINARY_VOCAB_SIZE); ids 256 and up are merges
# of printable ASCII text, so they always decode to text.
ORDINARY_VOCAB_SIZE = 2000
BYTE_TOKENS = 256
# Kimi reserves 256 special ids after its 163,584 ordinary ones.
SPECIAL_BASE_ID = 163584
SPECIAL_COUNT = 256
VOCAB_SIZE = SPECIAL_BASE_ID + SPECIAL_COUNT
CONTEXT_LENGTH = 16384

BOS = "[BOS]"
EOS = "[EOS]"
IM_END = "<|im_end|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_SYSTEM = "<|im_system|>"
IM_MIDDLE = "<|im_middle|>"
THINK = "<think>"
THINK_END = "</think>"
PAD = "[PAD]"

SPECIAL_TOKENS: dict[int, str] = {
    163584: BOS,
    163585: EOS,
    163586: IM_END,
    163587: IM_USER,
    163588: IM_ASSISTANT,
    163594: IM_SYSTEM,
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: IM_MIDDLE,
    163606: THINK,
    163607: THINK_END,
    163839: PAD,
}
"""Named special tokens by id; every other id in [163584, 163840) is a reserved token."""
SPECIAL_TOKENS_BY_NAME: dict[str, int] = {name: i for i, name in SPECIAL_TOKENS.items()}

# K2.5's shape: every turn is <|im_ROLE|>name<|im_middle|>content<|im_end|>; assistant turns
# before the last user turn are re-rendered with an empty <think></think>; the generation
# prompt opens the reasoning with <think> (or closes it at once when thinking is false).
CHAT_TEMPLATE = (
    "{%- macro content_text(message) -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set state = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set state.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set speaker = message['name'] or message['role'] -%}"
    "{%- if message['role'] == 'user' -%}"
    "<|im_user|>{{ speaker }}<|im_middle|>{{ content_text(message) }}<|im_end|>"
    "{%- elif message['role'] == 'assistant' -%}"
    "<|im_assistant|>{{ speaker }}<|im_middle|>"
    "{%- if loop.index0 > state.last_user and message['reasoning_content'] -%}"
    "<think>{{ message['reasoning_content'] }}</think>"
    "{%- else -%}"
    "<think></think>"
    "{%- endif -%}"
    "{{ content_text(message) }}"
    "{%- if message['tool_calls'] -%}"
    "<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set arguments = call['function']['arguments'] -%}"
    "<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- if arguments is string -%}{{ arguments }}{%- else -%}{{ arguments | tojson }}{%- endif -%}"
    "<|tool_call_end|>"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- elif message['role'] == 'tool' -%}"
    "<|im_system|>tool<|im_middle|>## Return of {{ message['tool_call_id'] }}{{ '\\n' }}"
    "{{ content_text(message) }}<|im_end|>"
    "{%- else -%}"
    "<|im_system|>{{ speaker }}<|im_middle|>{{ content_text(message) }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>"
    "{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

# Extra training text so the merges reach ORDINARY_VOCAB_SIZE; plain ASCII on purpose.
_EXTRA_CORPUS = """\
the of and to in is it that for you was with on as have be at by this from or had not but
what all were when we there can an your which their said if do will each about how up out
them then she many some so these would other into has more her two like him see time could
no make than first been its who now people my made over did down only way find use may water
long little very after words called just where most know get through back much before go good
new write our used me man too any day same right look think also around another came come
work three word must because does part even place well such here take why help put different
away again off went old number great tell men say small every found still between name should
home big give air line set own under read last never us left end along while might next sound
below saw something thought both few those always looked show large often together asked house
world going want school important until form food keep children feet land side without boy once
animal life enough took four head above kind began almost live page got earth need far hand
high year mother light country father let night picture being study second soon story since
white ever paper hard near sentence better best across during today however sure knew try told
young sun thing whole hear example heard several change answer room sea against top turned
learn point city play toward five himself usually money seen list problem question function
return value string integer number array class object method variable loop condition error
exception import module package library server client request response data table query index
database file path directory process thread memory cache network socket message queue worker
task result output input token model training sequence prompt template assistant user system
reasoning answer explain compute solve equation proof theorem matrix vector probability average
total count sum product difference ratio percent def self none true false print range len dict
list tuple set str int float async await yield lambda struct enum impl pub fn let mut const var
type interface public private static void while for if else elif try except finally raise
assert global nonlocal pass break continue with open close write read append insert remove sort
reverse filter map reduce zip enumerate sorted minimum maximum length height width area volume
triangle circle square rectangle angle radius diameter perimeter fraction decimal integer prime
factor multiple divisor remainder quotient derivative integral limit series function graph
slope intercept coordinate algebra geometry calculus statistics median mode variance deviation
history science nature energy planet ocean mountain river forest weather climate season summer
winter spring autumn morning evening friend family teacher student doctor engineer writer
artist music language culture country government economy market business customer company
team project meeting schedule budget report review feedback improve simple clear short brief
detailed careful honest helpful polite formal casual summary paragraph essay poem letter email
article blog recipe guide tutorial lesson chapter section title heading bullet step plan idea
reason because therefore although unless whether either neither rather quite almost already
"""


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: every byte as one printable character (GPT-2's mapping)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def _demo_prompts_bytes() -> bytes:
    return resources.files("app").joinpath("data/demo_prompts.jsonl").read_bytes()


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)


def _training_texts() -> list[str]:
    texts = [line for line in _EXTRA_CORPUS.splitlines() if line]
    texts += ["user", "assistant", "system", "tool", "tool_declare", "## Return of"]
    for raw in _demo_prompts_bytes().splitlines():
        if raw.strip():
            texts.extend(_strings(json.loads(raw)))
    return texts


def _special_token(token_id: int) -> str:
    return SPECIAL_TOKENS.get(token_id, f"<|reserved_token_{token_id - SPECIAL_BASE_ID}|>")


def _learn_merges() -> list[tuple[str, str]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=ORDINARY_VOCAB_SIZE + 1000,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    learner.train_from_iterator(_training_texts(), trainer=trainer)
    merges = json.loads(learner.to_str())["model"]["merges"]
    wanted = ORDINARY_VOCAB_SIZE - BYTE_TOKENS
    if len(merges) < wanted:
        raise RuntimeError(f"fixture corpus gave {len(merges)} merges, {wanted} needed")
    # A prefix of a BPE merge list is itself a valid BPE: keep exactly the merges we need.
    return [(str(a), str(b)) for a, b in merges[:wanted]]


def ordinary_token_bytes() -> list[bytes]:
    """The bytes of each ordinary id, in id order: the 256 bytes, then one per learned merge."""
    byte_of = {char: b for b, char in _bytes_to_unicode().items()}
    tokens = [bytes([b]) for b in range(BYTE_TOKENS)]
    for left, right in _learn_merges():
        tokens.append(bytes(byte_of[c] for c in left + right))
    return tokens


def _tokenizer_json() -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    # Byte b is id b, merges follow in learning order, specials sit on Kimi's ids. The ids
    # between are simply unused: no multi-megabyte filler vocabulary.
    vocab = {alphabet[b]: b for b in range(BYTE_TOKENS)}
    merges = _learn_merges()
    for index, (left, right) in enumerate(merges):
        vocab[left + right] = BYTE_TOKENS + index
    specials = [_special_token(i) for i in range(SPECIAL_BASE_ID, VOCAB_SIZE)]
    for offset, token in enumerate(specials):
        vocab[token] = SPECIAL_BASE_ID + offset
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # Already in the model vocabulary, so the added tokens keep those exact ids.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return str(tokenizer.to_str(pretty=False))


def _tokenizer_config() -> dict[str, Any]:
    added = {
        str(i): {
            "content": _special_token(i),
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i in range(SPECIAL_BASE_ID, VOCAB_SIZE)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT_LENGTH,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }


def _files() -> dict[str, str]:
    def dump(value: Any) -> str:
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    config = {
        "architectures": ["KimiK25FixtureForCausalLM"],
        "bos_token_id": SPECIAL_TOKENS_BY_NAME[BOS],
        "eos_token_id": SPECIAL_TOKENS_BY_NAME[EOS],
        "max_position_embeddings": CONTEXT_LENGTH,
        "vocab_size": VOCAB_SIZE,
    }
    generation = {"eos_token_id": SPECIAL_TOKENS_BY_NAME[IM_END], "max_length": CONTEXT_LENGTH}
    specials_map = {"bos_token": BOS, "eos_token": IM_END, "pad_token": PAD}
    return {
        "tokenizer.json": _tokenizer_json() + "\n",
        "tokenizer_config.json": dump(_tokenizer_config()),
        "special_tokens_map.json": dump(specials_map),
        "config.json": dump(config),
        "generation_config.json": dump(generation),
    }


def build_kimi_tokenizer(out_dir: Path) -> Path:
    """Write the fixture tokenizer folder into out_dir (created if needed) and return it.

    Deterministic: the same builder, demo prompts and `tokenizers` version give the same bytes.
    Loadable with `AutoTokenizer.from_pretrained(out_dir, local_files_only=True)`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in _files().items():
        (out_dir / name).write_text(text, encoding="utf-8")
    logger.debug("wrote Kimi fixture tokenizer to %s", out_dir)
    return out_dir


def fixture_version() -> str:
    """Changes whenever the builder, the demo prompts or the `tokenizers` library change."""
    import tokenizers

    digest = hashlib.sha256()
    digest.update(Path(__file__).read_bytes())
    digest.update(_demo_prompts_bytes())
    digest.update(str(tokenizers.__version__).encode())
    return digest.hexdigest()[:16]


_STAMP = ".fixture-version"


def ensure_kimi_tokenizer(cache_dir: Path) -> Path:
    """The fixture tokenizer in cache_dir/kimi-k2.5-fixture, built once and rebuilt on change."""
    return ensure_built(Path(cache_dir), FIXTURE_NAME, fixture_version(), build_kimi_tokenizer)


def ensure_built(cache_dir: Path, name: str, version: str, build: Callable[[Path], Path]) -> Path:
    """cache_dir/name as build writes it, rebuilt when version changes (a stamp file says).

    Safe when several processes race: each builds into a private folder and renames it in place.
    """
    target = cache_dir / name
    if _stamp(target) == version:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        build(staging)
        (staging / _STAMP).write_text(version + "\n", encoding="utf-8")
        for _ in range(3):
            try:
                os.rename(staging, target)
            except OSError:
                if _stamp(target) == version:
                    break
                shutil.rmtree(target, ignore_errors=True)
                continue
            logger.info("built fixture tokenizer %s %s at %s", name, version, target)
            break
        else:
            raise RuntimeError(f"could not put the fixture tokenizer in place at {target}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _stamp(folder: Path) -> str | None:
    try:
        return (folder / _STAMP).read_text(encoding="utf-8").strip()
    except OSError:
        return None
