"""What a chat template reads, found in its Jinja AST as SGLang 0.5.23 finds it: whether it takes
a message's content as a string or as a list of parts (`detect_content_format`), and whether
SGLang puts its tool results in call order before rendering it
(`template_may_reorder_tool_results`). Parsed with transformers' own chat-template environment."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from app.prompts.transformers_pin import imported_transformers

if TYPE_CHECKING:
    from app.prompts.chat_path import ContentFormat

logger = logging.getLogger(__name__)

# Template text that makes SGLang treat content as a list of parts without looking further.
_MULTIMODAL_WORDS = ("image", "audio", "video", "vision")
# The loop variables SGLang recognizes in `{% for x in message['content'] %}`.
_MESSAGE_VARIABLES = ("message", "msg", "m")


def detect_content_format(template: str | None) -> ContentFormat:
    """`openai` when the template iterates over a message's content (or mentions image, audio,
    video or vision anywhere), else `string`; a template that does not parse is `string`.

    The template is parsed with transformers' own chat-template Jinja environment, as SGLang
    does; the loop may be over `message`, `msg` or `m`, by key or attribute, through filters,
    tests or slices (`message['content'] | list`, `message.content[1:]`).
    """
    if not template:
        return "string"
    if any(word in template for word in _MULTIMODAL_WORDS):
        return "openai"
    try:
        import jinja2.nodes

        imported_transformers()
        from transformers.utils.chat_template_utils import _compile_jinja_template

        tree = _compile_jinja_template(template).environment.parse(template)
        loops = list(tree.find_all(jinja2.nodes.For))
    except Exception as exc:  # SGLang reads a template it cannot parse as "string"
        logger.debug("chat template does not parse (%s): content format 'string'", exc)
        return "string"
    for loop in loops:
        if any(_reads_content(loop.iter, name) for name in _MESSAGE_VARIABLES):
            return "openai"
    return "string"


def _reads_content(node: Any, variable: str) -> bool:
    """Whether node is `variable['content']` / `variable.content`, possibly filtered, tested
    or sliced."""
    import jinja2.nodes as nodes

    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads_content(node.node, variable)
    if isinstance(node, nodes.Test):
        return _reads_content(node.node, variable)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads_content(node.node, variable)
    if isinstance(node, nodes.Getitem):
        return (
            _is_load(node.node, variable)
            and isinstance(node.arg, nodes.Const)
            and node.arg.value == "content"
        )
    if isinstance(node, nodes.Getattr):
        return _is_load(node.node, variable) and node.attr == "content"
    return False


def _is_load(node: Any, variable: str) -> bool:
    import jinja2.nodes as nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == variable


_ATTRIBUTE_FILTERS = frozenset({"map", "rejectattr", "selectattr"})


def template_may_reorder_tool_results(template: str | None) -> bool:
    """Whether SGLang 0.5.23 puts a template's tool results in call order before rendering
    (`jinja_template_may_reorder_tool_results`): the template reads `tool_call_id` as an
    attribute, a subscript, a `.get()` argument, or the attribute of map/selectattr/
    rejectattr. None (the server renders, the template unknown here) counts as yes."""
    if template is None:
        return True
    from jinja2 import nodes

    try:  # parsed as SGLang parses it: with transformers' chat-template environment
        imported_transformers()
        from transformers.utils.chat_template_utils import _compile_jinja_template

        ast = _compile_jinja_template(template).environment.parse(template)
    except Exception:
        return False

    def named(node: Any) -> bool:
        return isinstance(node, nodes.Const) and node.value == "tool_call_id"

    if any(n.attr == "tool_call_id" for n in ast.find_all(nodes.Getattr)):
        return True
    if any(named(n.arg) for n in ast.find_all(nodes.Getitem)):
        return True
    for call in ast.find_all(nodes.Call):
        target = call.node
        is_get = isinstance(target, nodes.Getattr) and target.attr == "get"
        if is_get and call.args and named(call.args[0]):
            return True
    for flt in ast.find_all(nodes.Filter):
        if flt.name not in _ATTRIBUTE_FILTERS:
            continue
        if (flt.args and named(flt.args[0])) or any(
            k.key == "attribute" and named(k.value) for k in flt.kwargs
        ):
            return True
    return False
