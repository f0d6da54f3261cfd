"""`--turns all` on agentic rows against real Postgres: the target's own calls read with the run's
parser, the dataset's cached results spliced in, every chained prompt checked against SGLang
0.5.23's own code (the wheel's reasoning parser and function-call detector on the decoded
output, its request model and chat-path functions, the template), and every chain ending at
its first mismatch with the right reason (Kimi-shaped fixture; a Hermes/Qwen2.5-style template
read with hermes and with qwen25)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from app.core import constants
from app.core.contracts import GenerateResult, SamplingParams
from app.ledger import claims, reads, run_queries
from app.ledger import outcomes as ledger_outcomes
from app.outputs.export import export_run
from app.outputs.verify import verify_run
from app.prompts.tokenization import ChatTokenizer, load_tokenizer
from emulator.fixtures.kimi import IM_END, SPECIAL_TOKENS_BY_NAME
from tests.support import sglang_agent_loop
from tests.support.chat_templates import tokenizer_with_template
from tests.support.sglang_agent_loop import SGLangAgentLoop
from workers.chains.advance import advance
from workers.chains.tokenizers import TokenizerCache
from workers.intake.producer import EnqueueOptions, enqueue


def _tool(name: str, prop: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {prop: {"type": "string"}}}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [_tool("get_weather", "city"), _tool("search", "query")]
ARGS = {"get_weather": {"city": "Paris"}, "search": {"query": "tides"}}


def _call(name: str, call_id: str) -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps(ARGS[name])}
    return {"id": call_id, "type": "function", "function": function}


def _conversation(calls: list[list[str]], follow_up: bool = False) -> list[dict[str, Any]]:
    turns_: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Paris, then tides?"},
    ]
    for n, names in enumerate(calls):
        ids = [f"orig_{n}_{k}" for k in range(len(names))]
        calls_ = list(map(_call, names, ids))
        turns_.append({"role": "assistant", "content": "", "tool_calls": calls_})
        for name, call_id in zip(names, ids, strict=True):
            turns_.append({"role": "tool", "tool_call_id": call_id, "content": f"{name} says ok"})
    turns_.append({"role": "assistant", "content": "Done: sunny, tides at six."})
    if follow_up:
        turns_ += [{"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "x"}]
    return turns_


TWO = [["get_weather"], ["search"]]
EOS = SPECIAL_TOKENS_BY_NAME[IM_END]
MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class Script:
    """A row and what the target generates at each of its turns, with how its chain ends."""

    calls: list[list[str]]
    # per turn: a tool name (one call), "parallel", "malformed", "text", "cut" (max_new_tokens)
    actions: list[str]
    ending: str
    follow_up: bool = False


# what --parallel-calls in-order carries on (SCRIPTS end the same way under it)
IN_ORDER = [
    Script([["get_weather", "search"]], ["parallel", "text"], constants.CHAIN_END_COMPLETE),
    Script(
        [["get_weather", "search"]],
        ["parallel", "text", "text"],
        constants.CHAIN_END_COMPLETE,
        True,
    ),
    Script([["search", "get_weather"]], ["parallel"], constants.CHAIN_END_OTHER_TOOL),
]

SCRIPTS = [
    # SGLang's reasoning parser: the call section ends a reasoning block left open, and a block
    # never closed is all reasoning (a plain turn when a user turn is next)
    Script(TWO, ["early:get_weather", "search", "text"], constants.CHAIN_END_COMPLETE),
    Script(TWO, ["get_weather", "search", "unclosed", "text"], constants.CHAIN_END_COMPLETE, True),
    Script(TWO, ["get_weather", "search", "text"], constants.CHAIN_END_COMPLETE),
    Script(TWO, ["search"], constants.CHAIN_END_OTHER_TOOL),
    Script(TWO, ["get_weather", "parallel"], constants.CHAIN_END_PARALLEL_CALLS),
    Script(TWO, ["malformed"], constants.CHAIN_END_MALFORMED_CALL),
    Script(TWO, ["text"], constants.CHAIN_END_NO_CALL),
    Script(TWO, ["get_weather", "search", "search"], constants.CHAIN_END_RESULTS_EXHAUSTED),
    Script([["get_weather", "search"]], ["get_weather"], constants.CHAIN_END_PARALLEL_CALLS),
    Script(TWO, ["get_weather", "search", "text", "text"], constants.CHAIN_END_COMPLETE, True),
    Script(TWO, ["get_weather", "get_weather"], constants.CHAIN_END_OTHER_TOOL),
    Script(
        TWO,
        ["get_weather", "search", "text", "search"],
        constants.CHAIN_END_RESULTS_EXHAUSTED,
        True,
    ),
    # a turn cut at max_new_tokens ends the chain there, the first, a middle or the last one
    Script(TWO, ["cut"], constants.CHAIN_END_TRUNCATED),
    Script(TWO, ["get_weather", "cut"], constants.CHAIN_END_TRUNCATED),
    Script(TWO, ["get_weather", "search", "cut"], constants.CHAIN_END_TRUNCATED),
]


@dataclass(frozen=True)
class Family:
    name: str
    parser: str | None  # --tool-call-parser (None: detected)
    reasoning_parser: str | None  # the server's --reasoning-parser for the oracle

    def call_text(self, names: list[str], *, malformed: bool = False) -> str:
        if self.name == "kimi":
            body = "".join(
                f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>"
                + ('{"city": Paris}' if malformed else json.dumps(ARGS[n]))
                + "<|tool_call_end|>"
                for i, n in enumerate(names)
            )
            return f"Let me check.<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
        arguments = ['{"city": }' if malformed else json.dumps(ARGS[n]) for n in names]
        calls = [
            f'{{"name": "{n}", "arguments": {a}}}' for n, a in zip(names, arguments, strict=True)
        ]
        return "Let me check.\n" + "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)


FAMILIES = {
    "kimi": Family("kimi", None, "kimi_k2"),
    "hermes": Family("hermes", "hermes", None),
    "qwen25": Family("qwen25", "qwen25", None),
}


def _output_text(family: Family, action: str, key: str, turn: int) -> str:
    action = action.removeprefix("early:")
    if action == "unclosed":
        return ""
    if action in ("text", "cut"):
        return f"Answer {key} {turn}."
    if action == "parallel":
        return family.call_text(["get_weather", "search"])
    if action == "malformed":
        return family.call_text(["get_weather"], malformed=True)
    return family.call_text([action])


def _result(
    tokenizer: ChatTokenizer, family: Family, text: str, prompt_tokens: int, action: str
) -> GenerateResult:
    """The output ids: with a reasoning family (the template opened <think>) reasoning first,
    closed by </think> unless the action says otherwise: "early:NAME" opens the call section
    before any </think>, "unclosed" never closes it and says nothing else."""
    encode = tokenizer.hf_tokenizer.encode
    if action == "cut":  # max_new_tokens of text, no stop: reasoning never closed, or text
        ids = encode(f"{text} " * MAX_NEW_TOKENS, add_special_tokens=False)[:MAX_NEW_TOKENS]
        return GenerateResult("r", ids, "length", None, prompt_tokens, len(ids), 0, 0.1)
    ids: list[int] = []
    if family.reasoning_parser is not None:
        assert tokenizer.think_end_id is not None
        ids += encode("weighing it", add_special_tokens=False)
        if not action.startswith("early:") and action != "unclosed":
            ids.append(tokenizer.think_end_id)
    elif action == "unclosed":
        text = "weighing it"
    ids += [*encode(text, add_special_tokens=False), tokenizer.eos_token_ids[0]]
    return GenerateResult("r", ids, "stop", ids[-1], prompt_tokens, len(ids), 0, 0.1)


@pytest.fixture(params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> Family:
    return FAMILIES[request.param]


@pytest.fixture
def folder(family: Family, kimi_tokenizer_dir: Path, tmp_path: Path) -> Path:
    if family.name == "kimi":
        return Path(shutil.copytree(kimi_tokenizer_dir, tmp_path / "tok"))
    return tokenizer_with_template(
        kimi_tokenizer_dir, tmp_path / "tok", sglang_agent_loop.HERMES_TEMPLATE
    )


def _run_chains(
    db: Engine,
    tokenizer: ChatTokenizer,
    family: Family,
    path: Path,
    scripts: list[Script],
    parallel: str,
) -> int:
    options = EnqueueOptions(
        path,
        "agents",
        SamplingParams(max_new_tokens=MAX_NEW_TOKENS, seed=1),
        turns="all",
        tool_call_parser=family.parser,
        parallel_calls=parallel,
    )
    report = enqueue(db, tokenizer, options, publish=None)
    assert report.errors == []
    with db.connect() as conn:
        run = run_queries.get_run(conn, "agents")
    cache = TokenizerCache()
    while True:
        with db.connect() as conn:
            pending = list(reads.iter_items(conn, run.id, statuses=("pending",)))
        if not pending:
            return run.id
        done = []
        for item in pending:
            script = scripts[int(item.item_key)]
            action = script.actions[item.turn_index]
            text = _output_text(family, action, item.item_key, item.turn_index)
            result = _result(tokenizer, family, text, len(item.prompt_ids), action)
            done.append(ledger_outcomes.Done(item.id, result))
        with db.begin() as conn:
            ids = [d.item_id for d in done]
            claims.claim_items(conn, ids, owner="w", server="s", lease_s=60)
            ledger_outcomes.record_outcomes(conn, done, owner="w", lease_s=60)
        advance(db, cache, prev_ids=ids)


@pytest.mark.parametrize("parallel", list(constants.PARALLEL_CALLS))
def test_agentic_chains_splice_cached_results_as_sglang_renders_them(
    db: Engine, family: Family, folder: Path, tmp_path: Path, parallel: str
) -> None:
    scripts = SCRIPTS + (IN_ORDER if parallel == constants.PARALLEL_CALLS_IN_ORDER else [])
    tokenizer = load_tokenizer(folder)
    rows = [
        {"id": str(n), "messages": _conversation(s.calls, s.follow_up), "tools": TOOLS}
        for n, s in enumerate(scripts)
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_id = _run_chains(db, tokenizer, family, path, scripts, parallel)
    statuses = ("waiting", "pending", "queued", "leased", "done", "failed")
    with db.connect() as conn:
        found = list(reads.iter_items(conn, run_id, statuses=statuses))
        run = run_queries.get_run(conn, "agents")
    assert (run.generation.chat_pins or {})["tool_call_parser"] == (family.parser or "kimi_k2")
    in_order = parallel == constants.PARALLEL_CALLS_IN_ORDER
    assert (run.generation.chat_pins or {}).get("parallel_calls") == (
        parallel if in_order else None
    )
    assert {i.status for i in found} == {"done"}
    chains: dict[str, list[reads.StoredItem]] = {}
    for item in sorted(found, key=lambda i: i.turn_index):
        chains.setdefault(item.item_key, []).append(item)

    oracle = SGLangAgentLoop(folder, family.parser or "kimi_k2", family.reasoning_parser)
    checked = 0
    parsed = oracle.parse_all(
        [([i.output_ids for i in c[:-1]], TOOLS) for c in chains.values()],
        tokenizer.eos_token_ids[0],
    )
    for (key, chain), answers in zip(chains.items(), parsed, strict=True):
        script = scripts[int(key)]
        turns_done = [i.turn_index for i in chain]
        endings = [i.chain_end for i in chain]
        # the chain ends at its first mismatch: every turn up to it done, none after
        assert turns_done == list(range(len(script.actions))), key
        assert endings == [None] * (len(chain) - 1) + [script.ending], key
        checked += _check_prompts(oracle, family, rows[int(key)]["messages"], chain, answers)
    assert checked == sum(len(c) - 1 for c in chains.values()) > 0
    with db.connect() as conn:
        counted = reads.chain_endings(conn, run_id)
    assert counted == dict(sorted(Counter(s.ending for s in scripts).items()))

    # verify re-renders every chained prompt from its stored parsed history
    verified = verify_run(db, run, tokenizer)
    assert verified.clean, verified.to_json()
    assert verified.checks["template"].checked == len(found)

    # conversations rows (one per chain, its last kept turn): the parser, how the chain ended,
    # the history as it was rendered, the last turn's calls parsed
    out = tmp_path / "conv.jsonl"
    export_run(db, run, "conversations", out, tokenizer=tokenizer)
    exported = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert exported.keys() == chains.keys()
    for key, chain in chains.items():
        last = exported[key]
        assert last["conversations"][:-1] == chain[-1].messages
        assert last["tool_call_parser"] == (family.parser or "kimi_k2")
        assert last["chain_end"] == scripts[int(key)].ending
        final = last["conversations"][-1]
        calls = [c["function"]["name"] for c in final.get("tool_calls", [])]
        action = scripts[int(key)].actions[-1]
        expected = {"parallel": ["get_weather", "search"], "malformed": [], "text": [], "cut": []}
        assert calls == expected.get(action, [action]), key
    if family.name == "kimi":
        return  # its template drops earlier reasoning: no whole-conversation mask exists
    # specforge, one row per chain: the last turn's ids, every regenerated span trained
    whole = tmp_path / "whole.jsonl"
    export_run(db, run, "specforge", whole, tokenizer=tokenizer, whole_conversation=True)
    rows = {r["id"]: r for r in map(json.loads, whole.read_text().splitlines())}
    assert rows.keys() == chains.keys()
    for key, chain in chains.items():
        row, last_item = rows[key], chain[-1]
        assert row["input_ids"] == last_item.prompt_ids + (last_item.output_ids or [])
        mask = row["loss_mask"]
        spans = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
        assert spans == len(chain), key  # each regenerated turn's span, and no other
        assert mask[-len(last_item.output_ids or []) :] == [1] * len(last_item.output_ids or [])


def _check_prompts(
    oracle: SGLangAgentLoop,
    family: Family,
    conversation: list[dict[str, Any]],
    chain: list[Any],
    answers: list[dict[str, Any]],
) -> int:
    """Rebuild the chain's history as an agent loop against SGLang would, turn by turn, and
    compare each chained prompt with SGLang's render of it (answers: the wheel's parse of each
    output but the last)."""
    assistant_at = [i for i, t in enumerate(conversation) if t["role"] == "assistant"]
    history = [dict(t) for t in conversation[: assistant_at[0]]]
    assert chain[0].prompt_ids == oracle.render(history, TOOLS)
    for n, (item, answer) in enumerate(zip(chain[1:], answers, strict=True)):
        message: dict[str, Any] = {"role": "assistant", "content": answer["normal_text"] or ""}
        if answer["reasoning_text"]:
            message["reasoning_content"] = answer["reasoning_text"]
        dataset_next = conversation[assistant_at[n] + 1 : assistant_at[n + 1]]
        if answer["calls"]:
            stored = [t for t in item.messages if t.get("tool_calls")][-1]["tool_calls"]
            ids = [call["id"] for call in stored]
            count = sum(len(t.get("tool_calls") or []) for t in history)
            message["tool_calls"] = []
            for k, (_, name, arguments) in enumerate(answer["calls"]):
                if family.name == "kimi":  # SGLang's `_process_tool_call_id` for kimi_k2
                    assert ids[k] == f"functions.{name}:{count + k}"
                else:  # SGLang draws call_ + 24 hex digits; the template does not render it
                    assert ids[k].startswith("call_") and len(ids[k]) == 29
                function = {"name": name, "arguments": arguments}
                message["tool_calls"].append(
                    {"id": ids[k], "type": "function", "function": function}
                )
            assert len(set(ids)) == len(ids) == len(answer["calls"])
            # each cached result answers the regenerated call in its dataset call's place
            dataset_ids = [c["id"] for c in conversation[assistant_at[n]]["tool_calls"]]
            results = [t for t in dataset_next if t["role"] == "tool"]
            rest = dataset_next[len(results) :]
            spliced = [
                {**r, "tool_call_id": ids[dataset_ids.index(r["tool_call_id"])]} for r in results
            ]
            history += [message, *spliced, *rest]
        else:
            history += [message, *dataset_next]
        assert item.prompt_ids == oracle.render(history, TOOLS), (item.item_key, item.turn_index)
    return len(chain) - 1
