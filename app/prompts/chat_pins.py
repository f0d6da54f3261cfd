"""What a run pins about how its prompts are rendered, besides the template text: the named
template or `--chat-template` file (with its sha256), `--pass-turn-fields`, and the transformers
version the client renders with next to the server's version it renders as.

Stored as one JSON object (`runs.chat_pins`); `pins_of` builds it from a loaded tokenizer,
`choice_of` reads back what a later command loads the tokenizer with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.errors import TokenizerError
from app.prompts.template_choice import ChosenTemplate, TemplateChoice


def pins_of(
    template: ChosenTemplate, pass_turn_fields: bool, transformers: Mapping[str, str] | None
) -> dict[str, Any]:
    """The run's chat pins; transformers is None for a run rendered on the server."""
    pins: dict[str, Any] = {
        "chat_template_name": template.name,
        "chat_template_file": template.file,
        "chat_template_file_hash": template.file_hash,
        "pass_turn_fields": pass_turn_fields,
    }
    if template.on_server:
        pins["template_on_server"] = True
    if transformers is not None:
        pins["transformers"] = transformers.get("client")
        pins["renders_as"] = transformers.get("renders_as")
    return pins


def run_pins(tokenizer: Any, *, rendered_here: bool) -> dict[str, Any]:
    """The pins of a run built with tokenizer (an app.prompts.tokenization.ChatTokenizer);
    rendered_here: the client renders (not --render-with), so its transformers must be one that
    renders as the server's (ConfigurationError naming both otherwise)."""
    versions = tokenizer.transformers_pin().to_json() if rendered_here else None
    return pins_of(tokenizer.template, tokenizer.pass_turn_fields, versions)


def rendered_on_server(pins: Mapping[str, Any] | None) -> bool:
    """Whether the run's folder has no chat template and its server renders every prompt."""
    return bool((pins or {}).get("template_on_server"))


def with_server_render(pins: Mapping[str, Any], probe_sha256: str) -> dict[str, Any]:
    """The pins of a run rendered by the server, with the sha256 of the server's answers to
    the render probe (`app.sglang.render.RENDER_PROBE`): a later enqueue whose server renders
    otherwise is refused by it."""
    return {**pins, "server_render_sha256": probe_sha256}


def choice_of(pins: Mapping[str, Any] | None) -> tuple[TemplateChoice, bool]:
    """The template choice and --pass-turn-fields a run pinned (older runs: the defaults)."""
    if not pins:
        return TemplateChoice(), False
    choice = TemplateChoice(pins.get("chat_template_name"), pins.get("chat_template_file"))
    return choice, bool(pins.get("pass_turn_fields"))


def check_file_unchanged(pins: Mapping[str, Any] | None, template: ChosenTemplate) -> None:
    """TokenizerError when the run's --chat-template file no longer has the pinned sha256."""
    pinned = (pins or {}).get("chat_template_file_hash")
    if pinned is not None and pinned != template.file_hash:
        raise TokenizerError(
            f"the chat template file {template.file} changed since the run pinned it (sha256 "
            f"{str(pinned)[:12]} → {str(template.file_hash)[:12]})"
        )
