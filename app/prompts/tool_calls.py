"""A target's generated text read as SGLang 0.5.23's function-call parsers read it (non-streaming
`detect_and_parse` of `kimi_k2`, `qwen25`, `hermes`, `deepseekv31`), and whether an agentic chain
goes on.

The parse runs in the client, not through the server's `/parse_function_call`: it is a pure
function of the text and the request's tools, so a chain step costs no round trip;
test_tool_call_oracle.py checks it against the wheel's own detectors. Tools are OpenAI-shaped
dicts (`{"type": "function", "function": {"name", "parameters"}}`), as the rows carry them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.core import constants
from app.core.errors import InputError
from app.core.run_kinds import TurnsMode

if TYPE_CHECKING:
    from app.prompts.tokenization import ChatTokenizer


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: SGLang's ToolCallItem (`tool_index`, `name`, `parameters` as JSON text)."""

    tool_index: int
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedTurn:
    """A turn's text split as the server splits it: the content before the calls, the calls, and
    how many call openings the text had (more openings than calls: a call was dropped)."""

    content: str
    calls: tuple[ToolCall, ...]
    openings: int


_KIMI_SECTION = "<|tool_calls_section_begin|>"
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[^\s<|]+)\s*<\|tool_call_argument_begin\|>\s*"
    r"(?P<args>\{.*?\})\s*<\|tool_call_end\|>",
    re.DOTALL,
)
_KIMI_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)$")
_KIMI_COUNTER = re.compile(r"^\d+$")
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function")
    return function if isinstance(function, Mapping) else {}


def _properties(schema: Any) -> dict[str, Any]:
    if not isinstance(schema, Mapping):
        return {}
    properties = schema.get("properties")
    if isinstance(properties, Mapping):
        return dict(properties)
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(keyword)
        if isinstance(branches, list):
            for branch in branches:
                for key, value in _properties(branch).items():
                    merged.setdefault(key, value)
    return merged


def _kimi_inferred_name(tools: Sequence[Mapping[str, Any]], args: str) -> str | None:
    # a bare call counter names no tool: SGLang picks the tool whose properties fit the arguments
    if not tools:
        return None
    if len(tools) == 1:
        name = _function(tools[0]).get("name")
        return name if isinstance(name, str) else None
    try:
        keys = set(json.loads(args).keys())
    except (json.JSONDecodeError, TypeError, AttributeError):
        return None
    best, best_score = None, -1
    for tool in tools:
        props = set(_properties(_function(tool).get("parameters") or {}))
        if not props:
            continue
        score = len(keys & props) - len(keys - props)
        if score > best_score:
            best, best_score = _function(tool).get("name"), score
    return best if isinstance(best, str) else None


def _kimi(text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedTurn:
    if _KIMI_SECTION not in text:
        return ParsedTurn(text, (), 0)
    calls: list[ToolCall] = []
    for match in _KIMI_CALL.finditer(text):
        call_id, args = match.group("id"), match.group("args")
        named = _KIMI_ID.match(call_id)
        name = named.group("name") if named else None
        if named is None and _KIMI_COUNTER.match(call_id):
            name = _kimi_inferred_name(tools, args)
        if name is not None:
            calls.append(ToolCall(len(calls), name, args))
    return ParsedTurn(
        text[: text.find(_KIMI_SECTION)], tuple(calls), text.count("<|tool_call_begin|>")
    )


def _base_json(action: Any, tools: Sequence[Mapping[str, Any]]) -> list[ToolCall]:
    # BaseFormatDetector.parse_base_json: unknown tools are dropped, arguments re-serialized
    indices = {_function(t).get("name"): i for i, t in enumerate(tools)}
    calls = []
    for act in action if isinstance(action, list) else [action]:
        if not isinstance(act, Mapping):
            raise InputError(f"a tool call is not a JSON object: {act!r}")
        name = act.get("name")
        if not (name and name in indices):
            continue
        arguments = act.get("parameters") or act.get("arguments", {})
        calls.append(ToolCall(indices[name], name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _qwen25(text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedTurn:
    bot, eot = "<tool_call>\n", "\n</tool_call>"
    if bot not in text:
        return ParsedTurn(text, (), 0)
    calls: list[ToolCall] = []
    for raw in re.findall(rf"{re.escape(bot)}(.*?){re.escape(eot)}", text, re.DOTALL):
        try:
            parsed = json.loads(raw.strip())
        except json.JSONDecodeError:
            continue
        calls.extend(_base_json(parsed, tools))
    return ParsedTurn(text[: text.find(bot)].strip(), tuple(calls), text.count("<tool_call>"))


def _hermes(text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedTurn:
    if "<tool_call>" not in text:
        return ParsedTurn(text, (), 0)
    openings = text.count("<tool_call>")
    calls: list[ToolCall] = []
    try:
        for match in _HERMES_CALL.findall(text):
            raw = match[0] or match[1]
            if raw:
                calls.extend(_base_json(json.loads(raw.strip()), tools))
    except (json.JSONDecodeError, InputError):
        # HermesDetector gives up on the whole text when one call does not parse
        return ParsedTurn(text, (), openings)
    return ParsedTurn(text[: text.find("<tool_call>")].strip(), tuple(calls), openings)


_DS_BOT = "<｜tool▁calls▁begin｜>"
_DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
_DS_CALL = re.compile(f"{_DS_CALL_BEGIN}.*?<｜tool▁call▁end｜>", re.DOTALL)
_DS_DETAIL = re.compile(
    f"{_DS_CALL_BEGIN}(.*)<｜tool▁sep｜>(.*)<｜tool▁call▁end｜>",
    re.DOTALL,
)


def _deepseekv31(text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedTurn:
    # DeepSeekV31Detector: `name<｜tool▁sep｜>{json}` per call; one call that does not parse
    # and the whole text is the answer, no call
    if _DS_BOT not in text:
        return ParsedTurn(text, (), 0)
    openings = text.count(_DS_CALL_BEGIN)
    calls: list[ToolCall] = []
    try:
        for raw in _DS_CALL.findall(text):
            detail = _DS_DETAIL.search(raw)
            if detail is None:
                raise InputError("a DeepSeek tool call without its separator")
            arguments = json.loads(detail.group(2))
            calls.extend(_base_json({"name": detail.group(1), "parameters": arguments}, tools))
    except (json.JSONDecodeError, InputError):
        return ParsedTurn(text, (), openings)
    return ParsedTurn(text[: text.find(_DS_BOT)].strip(), tuple(calls), openings)


_PARSERS = {"kimi_k2": _kimi, "qwen25": _qwen25, "hermes": _hermes, "deepseekv31": _deepseekv31}
# SGLang's ToolCallParserEnum maps "qwen" (the name its template detection gives) to qwen25's
ALIASES = {"qwen": "qwen25"}


# what ends an unterminated reasoning block for each parser's family: the tool-call start of
# SGLang's reasoning parser for it (KimiK2Detector's, and Qwen3Detector's for the Qwen/Hermes
# format: `tool_start_token`)
REASONING_INTERRUPTS = {
    "kimi_k2": _KIMI_SECTION,
    "qwen25": "<tool_call>",
    "hermes": "<tool_call>",
    "deepseekv31": "<tool_call>",  # its reasoning parser, deepseek-v3, is Qwen3's
}


def reasoning_interrupt_id(parser: str, tokenizer: ChatTokenizer) -> int | None:
    """The id of the token that ends an unterminated reasoning block in this parser's family
    (None: it is not one token of this vocabulary, and nothing ends such a block early)."""
    token = REASONING_INTERRUPTS.get(parser_name(parser))
    return None if token is None else tokenizer.single_token_id(token)


def parser_name(name: str) -> str:
    """SGLang's `--tool-call-parser` name as this module knows it; InputError if not supported."""
    name = ALIASES.get(name, name)
    if name not in _PARSERS:
        known = ", ".join(constants.TOOL_CALL_PARSERS)
        raise InputError(f"tool-call parser {name!r} is not supported; one of {known}")
    return name


def _has_all(template: str, *needles: str) -> bool:
    return all(needle in template for needle in needles)


# SGLang 0.5.23's TOOL_CALL_PARSER_RULES (`template_detection.py`) in their order, up to and
# including kimi_k2, the first rule that names a parser implemented here: the parser the first
# matching rule names, from the chat template's text and the vocabulary. A template none of
# them matches gets no parser here (SGLang's later rules read its reasoning toggles).
_SGLANG_RULES: tuple[tuple[str, Callable[[str, Collection[str]], bool]], ...] = (
    ("iquest_q1", lambda t, v: "<|iquest_assistant|>" in t),
    ("gigachat35", lambda t, v: "<\uff5cGCML\uff5ctool_calls>" in t),
    ("k2_horizon", lambda t, v: _has_all(t, "<ifm|think>", "<ifm|tool_calls>", "<ifm|tool_call>")),
    ("apertus2509", lambda t, v: "<|inner_prefix|>" in v),
    ("gemma4", lambda t, v: "<|channel>" in t),
    ("beam", lambda t, v: _has_all(t, "<|channel|>", "<rfl:parameter")),
    ("gpt-oss", lambda t, v: "<|channel|>" in t),
    ("kimi_k2", lambda t, v: _KIMI_SECTION in v),
)


def detected_parser(template: str, vocab: Collection[str]) -> str | None:
    """The tool-call parser SGLang's template detection names for this template and vocabulary,
    as far as its rules up to kimi_k2 go (None: none of them matches)."""
    for name, matches in _SGLANG_RULES:
        if matches(template, vocab):
            return name
    return None


def choose_parser(explicit: str | None, vocab: Collection[str], template: str = "") -> str | None:
    """The parser a server of this tokenizer uses: `--tool-call-parser` when given, else SGLang's
    template detection (`--tool-call-parser auto`, `detected_parser`) when it names a parser
    implemented here. None: the server would name none that this module has (or one it does
    not implement), and the run must be told."""
    if explicit is not None:
        return parser_name(explicit)
    detected = detected_parser(template, vocab)
    return detected if detected in _PARSERS else None


def parse(parser: str, text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedTurn:
    """The text as SGLang's `--tool-call-parser parser` parses a whole response. Raises InputError
    for a parser not implemented here, or (qwen25) for a call that is JSON but not an object, where
    the wheel's detector raises too."""
    return _PARSERS[parser_name(parser)](text, tools)


def chain_ending(turn: ParsedTurn, next_tool: str | None) -> str | None:
    """How a chain ends after this regenerated turn, or None if it goes on. next_tool is the name
    of the dataset's next cached tool result (None: the dataset has no result left)."""
    if turn.openings > len(turn.calls) or any(not _is_object(c.arguments) for c in turn.calls):
        return constants.CHAIN_END_MALFORMED_CALL
    if not turn.calls:
        return constants.CHAIN_END_COMPLETE if next_tool is None else constants.CHAIN_END_NO_CALL
    if len(turn.calls) > 1:
        return constants.CHAIN_END_PARALLEL_CALLS
    if next_tool is None:
        return constants.CHAIN_END_RESULTS_EXHAUSTED
    if turn.calls[0].name != next_tool:
        return constants.CHAIN_END_OTHER_TOOL
    return None


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except json.JSONDecodeError:
        return False


def call_id(parser: str, call: ToolCall, history_calls: int, seed: str, position: int = 0) -> str:
    """The id SGLang's chat endpoint gives a parsed call (`_process_tool_call_id`): Kimi-K2's
    `functions.{name}:{n}` counting the history's earlier calls; for other parsers SGLang draws
    `call_` + 24 random hex digits for each call, here derived from seed (the item key) and the
    call's position in its turn, so a rerun repeats them and parallel calls of one tool (one
    tool_index) differ."""
    if parser == "kimi_k2":
        return f"functions.{call.name}:{history_calls + call.tool_index}"
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"


def spliced_result(tool_message: Mapping[str, Any], regenerated_id: str) -> dict[str, Any]:
    """The dataset's cached tool message, answering the regenerated call: its tool_call_id is
    rewritten to the regenerated call's id, everything else kept."""
    return {**tool_message, "tool_call_id": regenerated_id}


@dataclass(frozen=True)
class ChainStep:
    """One regenerated turn of an agentic chain, read against the dataset's next turn.

    ending: None when the chain goes on, else how it ends here (CHAIN_END_*). turns: what the
    next prompt's history gains after this turn's prompt turns: the regenerated assistant
    message (its calls with SGLang's ids), the dataset's cached results answering them
    (tool_call_id rewritten), then the dataset's other turns before the next assistant turn."""

    parsed: ParsedTurn
    ending: str | None
    turns: list[dict[str, Any]] = field(default_factory=list)


def history_call_count(history: Sequence[Mapping[str, Any]]) -> int:
    """The calls of the history's assistant turns (SGLang's `_get_history_tool_calls_cnt`)."""
    return sum(len(t.get("tool_calls") or []) for t in history if t.get("role") == "assistant")


def cached_results(
    context: Sequence[Mapping[str, Any]],
) -> tuple[list[str | None], list[dict[str, Any]], list[dict[str, Any]]]:
    """A waiting turn's stored context split: the tool names its leading tool results answer
    (from the dataset's assistant turn kept first in the context, by tool_call_id, else by
    position, else the result's own `name`), those results, and the turns after them."""
    cached = _cached(context)
    return cached.names, cached.results, cached.rest


@dataclass(frozen=True)
class _Cached:
    """What cached_results gives, and the dataset's calls: their names in order, and for each
    result the position of the call it answers (None: none found)."""

    names: list[str | None]
    results: list[dict[str, Any]]
    rest: list[dict[str, Any]]
    call_names: list[str | None]
    answers: list[int | None]


def _cached(context: Sequence[Mapping[str, Any]]) -> _Cached:
    turns = [dict(t) for t in context]
    dataset_calls: list[Mapping[str, Any]] = []
    if turns and turns[0].get("role") == "assistant":
        dataset_calls = list(turns.pop(0).get("tool_calls") or [])
    results: list[dict[str, Any]] = []
    while turns and turns[0].get("role") == "tool":
        results.append(turns.pop(0))
    position_of = {c.get("id"): n for n, c in enumerate(dataset_calls) if c.get("id")}
    names: list[str | None] = []
    answers: list[int | None] = []
    for position, result in enumerate(results):
        answered = position_of.get(result.get("tool_call_id"))
        if answered is None and position < len(dataset_calls):
            answered = position
        name = _function(dataset_calls[answered]).get("name") if answered is not None else None
        names.append(name if isinstance(name, str) else result.get("name"))
        answers.append(answered)
    call_names = [_name_of(c) for c in dataset_calls]
    return _Cached(names, results, turns, call_names, answers)


def _name_of(call: Mapping[str, Any]) -> str | None:
    name = _function(call).get("name")
    return name if isinstance(name, str) else None


def _in_order_ending(parsed: ParsedTurn, cached: _Cached) -> str | None:
    """--parallel-calls in-order: a turn of several calls (or a dataset turn of several results)
    goes on when the target makes as many well-formed calls as the dataset made, the i-th to
    the dataset's i-th tool, and each result answers one of those calls; else how it ends."""
    if parsed.openings > len(parsed.calls) or any(
        not _is_object(c.arguments) for c in parsed.calls
    ):
        return constants.CHAIN_END_MALFORMED_CALL
    if not parsed.calls:
        return constants.CHAIN_END_NO_CALL
    if not cached.results:
        return constants.CHAIN_END_RESULTS_EXHAUSTED
    answered = sorted(a for a in cached.answers if a is not None)
    expected = list(range(len(cached.call_names)))
    if len(parsed.calls) != len(cached.call_names) or answered != expected:
        return constants.CHAIN_END_PARALLEL_CALLS
    if any(c.name != n for c, n in zip(parsed.calls, cached.call_names, strict=True)):
        return constants.CHAIN_END_OTHER_TOOL
    return None


def chain_step(
    parser: str,
    regenerated: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]],
    history: Sequence[Mapping[str, Any]],
    context: Sequence[Mapping[str, Any]],
    seed: str,
    parallel: str = constants.PARALLEL_CALLS_END,
) -> ChainStep:
    """Read a regenerated assistant turn (its `content`, the reasoning already split off into
    `reasoning_content`) as SGLang's chat endpoint does and splice the dataset's cached results
    in. A turn goes on when it makes one well-formed call to the tool whose result the dataset
    has next (one result), or makes no call where the dataset has no result next (a plain
    turn); with parallel "in-order", also when it makes the dataset's parallel calls, the i-th
    to the dataset's i-th tool (each result then answers the regenerated call in its place).
    history: this turn's prompt turns; context: the waiting turn's stored context (the
    dataset's assistant turn first, then its results, then the turns after them). seed: the
    item's key, for the ids of parsers whose SGLang ids are random."""
    parsed = parse(parser, str(regenerated.get("content") or ""), tools)
    cached = _cached(context)
    names, results, rest = cached.names, cached.results, cached.rest
    several = len(parsed.calls) > 1 or len(results) > 1
    if parallel == constants.PARALLEL_CALLS_IN_ORDER and several:
        ending = _in_order_ending(parsed, cached)
    else:
        ending = chain_ending(parsed, names[0] if names else None)
    if ending == constants.CHAIN_END_COMPLETE:
        ending = None  # no call, no result next: a plain turn, the dataset goes on
    elif ending is None and len(results) > 1 and len(parsed.calls) == 1:
        ending = constants.CHAIN_END_PARALLEL_CALLS  # the dataset's results answer parallel calls
    if ending is not None:
        return ChainStep(parsed, ending)
    if not parsed.calls:
        return ChainStep(parsed, None, [dict(regenerated), *rest])
    count = history_call_count(history)
    ids = [call_id(parser, c, count, seed, n) for n, c in enumerate(parsed.calls)]
    message = {
        **regenerated,
        "content": parsed.content,
        "tool_calls": [
            {
                "id": regenerated_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c, regenerated_id in zip(parsed.calls, ids, strict=True)
        ],
    }
    # one call answers the one result; in order, each result the call in its dataset place
    spliced = [
        spliced_result(result, ids[0 if len(ids) == 1 else answered or 0])
        for result, answered in zip(results, cached.answers, strict=True)
    ]
    return ChainStep(parsed, None, [message, *spliced, *rest])


def final_ending(parser: str, answer: str, tools: Sequence[Mapping[str, Any]]) -> str:
    """How a chain ends at its last turn (the dataset has no turn after it): complete, or a
    call with no result left for it (malformed, parallel calls and results exhausted alike)."""
    parsed = parse(parser, answer, tools)
    ending = chain_ending(parsed, None)
    return constants.CHAIN_END_COMPLETE if ending is None else ending


def item_seed(item_key: str, sample_index: int, turn_index: int) -> str:
    """What a regenerated call's id is derived from (parsers whose SGLang ids are random)."""
    return f"{item_key}:{sample_index}:{turn_index}"


def chain_parser(
    chat_pins: Mapping[str, Any] | None,
    turns: TurnsMode,
    tools: Sequence[Any] | None,
    messages: Sequence[Mapping[str, Any]] | None,
) -> str | None:
    """The run's tool-call parser if an item's chain is agentic (a `--turns all` run with a
    parser pinned, the row with tools or tool turns), else None: a plain chain."""
    parser = (chat_pins or {}).get("tool_call_parser")
    if parser is None or not TurnsMode(turns).chains:
        return None
    calls = any(t.get("role") == "tool" or t.get("tool_calls") for t in messages or [])
    return str(parser) if tools or calls else None


def final_message(
    parser: str,
    regenerated: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]],
    seed: str,
    history: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """A chain's last regenerated turn as the chat endpoint returns it: its well-formed calls
    parsed out of the content (with SGLang's ids), else the turn as it is."""
    parsed = parse(parser, str(regenerated.get("content") or ""), tools)
    if not parsed.calls or chain_ending(parsed, None) == constants.CHAIN_END_MALFORMED_CALL:
        return dict(regenerated)
    count = history_call_count(history)
    return {
        **regenerated,
        "content": parsed.content,
        "tool_calls": [
            {
                "id": call_id(parser, call, count, seed, position),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for position, call in enumerate(parsed.calls)
        ],
    }
