"""`python -m tests.support.sglang_tool_parser < cases.json`: SGLang 0.5.23's own function-call
detectors (`sglang/srt/function_call/`, from the extracted wheel, GPU stack stubbed) run on each
case; prints one JSON answer per case. `wheel_parses(cases)` runs it in a subprocess.

A case is {"parser", "text", "tools"} and, optionally, {"reasoning_parser", "force_reasoning"}: the
chat endpoint's order, the wheel's ReasoningParser first (non-streaming), the detector on its
normal text. An answer is {"normal_text", "reasoning_text", "calls": [[tool_index, name,
parameters], ...]} or {"error": exception class name} when the detector raises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.support.sglang_http import harness


def wheel_parses(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.sglang_tool_parser"],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=harness.server_env(),
        check=False,
        cwd=harness.REPO_ROOT,
    )
    assert done.returncode == 0, f"the wheel's parsers failed:\n{done.stderr[-3000:]}"
    answers: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return answers


def _main() -> None:
    sys.path.append(os.environ["HARNESS_SGLANG_DEPS"])
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from tests.support.sglang_http import stubs

    stubs.install()
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    answers = []
    for case in json.loads(sys.stdin.read()):
        if "template" in case:
            answers.append({"parser": _detected(case["template"], set(case["vocab"]))})
            continue
        tools = [Tool.model_validate(t) for t in case["tools"]]
        detector = FunctionCallParser.ToolCallParserEnum[case["parser"]]()
        text, reasoning = case["text"], None
        if case.get("reasoning_parser"):
            reasoner = ReasoningParser(
                case["reasoning_parser"],
                stream_reasoning=False,
                force_reasoning=case.get("force_reasoning"),
            )
            reasoning, text = reasoner.parse_non_stream(text)
        try:
            result = detector.detect_and_parse(text, tools)
        except Exception as exc:  # the detector's own failure is part of the answer
            answers.append({"error": type(exc).__name__})
            continue
        calls = [[c.tool_index, c.name, c.parameters] for c in result.calls]
        answers.append(
            {"normal_text": result.normal_text, "reasoning_text": reasoning, "calls": calls}
        )
    print(json.dumps(answers))


def _detected(template: str, vocab: set[str]) -> str | None:
    """The wheel's `--tool-call-parser auto` for a template and vocabulary, as its template
    manager runs it: the reasoning pattern first, then the tool-call parser rules."""
    from sglang.srt.parser import template_detection as td

    force, config = td.detect_reasoning_pattern(template)
    ctx = td.TemplateDetectionContext(
        template=template, reasoning_config=config, force_reasoning=force, vocab=vocab
    )
    parser: str | None = td.match_rules(ctx, td.TOOL_CALL_PARSER_RULES, "tool-call parser")
    return parser


if __name__ == "__main__":
    _main()
