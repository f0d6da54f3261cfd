"""Tool declarations as TypeScript: the text the Kimi-shaped fixture template puts in the prompt.

A helper module beside the tokenizer code, as in Kimi-K2.5's folder: changing it changes prompts.
"""

from __future__ import annotations

import json
from typing import Any

_SCALARS = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean"}


def _type_of(schema: Any, indent: str) -> str:
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema and isinstance(schema["enum"], list):
        return " | ".join(json.dumps(value, ensure_ascii=False) for value in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_type_of({**schema, "type": k}, indent) for k in kind)
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "null":
        return "null"
    if kind == "array":
        return f"Array<{_type_of(schema.get('items'), indent)}>"
    if kind == "object" or "properties" in schema:
        return _object(schema, indent)
    return "any"


def _object(schema: dict[str, Any], indent: str) -> str:
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        return "object"
    required = set(schema.get("required") or [])
    inner = indent + "  "
    lines = ["{"]
    for name, prop in properties.items():
        description = prop.get("description") if isinstance(prop, dict) else None
        if isinstance(description, str) and description:
            lines.extend(f"{inner}// {text}" for text in description.splitlines())
        optional = "" if name in required else "?"
        lines.append(f"{inner}{name}{optional}: {_type_of(prop, inner)},")
    lines.append(indent + "}")
    return "\n".join(lines)


def _function(tool: dict[str, Any]) -> str:
    function = tool.get("function", tool)
    if not isinstance(function, dict):
        raise ValueError(f"a tool must be an object with a 'function', not {tool!r}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool function needs a 'name': {function!r}")
    lines: list[str] = []
    description = function.get("description")
    if isinstance(description, str) and description:
        lines.extend(f"// {text}" for text in description.splitlines())
    parameters = function.get("parameters")
    if isinstance(parameters, dict) and parameters.get("properties"):
        lines.append(f"type {name} = (_: {_object(parameters, '')}) => any;")
    else:
        lines.append(f"type {name} = () => any;")
    return "\n".join(lines)


def encode_tools_to_typescript_style(tools: list[dict[str, Any]]) -> str:
    """The tools list (OpenAI function schemas, or bare function objects) as one namespace."""
    body = "\n\n".join(_function(tool) for tool in tools)
    return f"# Tools\n\n## functions\nnamespace functions {{\n{body}\n}}\n"
