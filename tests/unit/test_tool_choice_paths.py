"""A row's named tool_choice as each of SGLang's render paths applies it: its Jinja path and
most encoders render the chosen tool, its DeepSeek-V3.2 encoder every tool of the request; and
which folders SGLang 0.5.23 renders with that encoder (`resolve_chat_encoding_spec`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.core.errors import InputError
from app.prompts.request_fields import tools_for_choice
from app.prompts.tokenizer_config import renders_with_dsv32_encoder

WEATHER = {"type": "function", "function": {"name": "get_weather"}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_choice_picks_its_tool_unless_the_path_renders_every_tool() -> None:
    assert tools_for_choice([WEATHER, TIME], NAMED) == [WEATHER]
    assert tools_for_choice([WEATHER, TIME], NAMED, every_tool=True) == [WEATHER, TIME]
    assert tools_for_choice([WEATHER, TIME], "none", every_tool=True) is None
    with pytest.raises(InputError, match=r"Tool 'get_time' not found in tools list\."):
        tools_for_choice([WEATHER], {"function": {"name": "get_time"}}, every_tool=True)


@pytest.mark.parametrize(
    ("config", "template", "dsv32"),
    [
        ({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}, False, True),
        ({"architectures": ["DeepseekV3ForCausalLM"]}, False, True),
        ({"architectures": ["DeepseekV3ForCausalLM"]}, True, False),  # its Jinja template
        ({"architectures": ["DeepseekV4ForCausalLM"]}, False, False),  # the V4 encoder
        ({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v41"}, False, False),
        ({"architectures": ["Qwen3ForCausalLM"]}, False, False),
        ({}, False, False),
    ],
)
def test_which_folders_sglang_renders_with_the_dsv32_encoder(
    tmp_path: Path, config: dict[str, Any], template: bool, dsv32: bool
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert renders_with_dsv32_encoder(tmp_path, template) is dsv32
