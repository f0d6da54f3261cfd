"""Tool parameter schemas as SGLang 0.5.23's request validation leaves them before rendering.

SGLang rewrites database-style `type` names in a tool's `parameters` (`varchar` → `string`, `int`
→ `integer`, `list[str]` → `array`, ...) in place, then checks the schema against JSON Schema
2020-12 and refuses the request (400) if it is not one; the template renders the rewritten schema.
"""

from __future__ import annotations

from typing import Any

from app.core.errors import InputError

_STANDARD = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
_ALIASES = {
    **dict.fromkeys(
        [
            "str",
            "text",
            "varchar",
            "char",
            "enum",
            "uuid",
            "date",
            "datetime",
            "time",
            "timestamp",
            "binary",
            "blob",
            "bytea",
            "bytes",
            "varbinary",
        ],
        "string",
    ),
    "bool": "boolean",
    **dict.fromkeys(("bigint", "smallint", "tinyint"), "integer"),
    **dict.fromkeys(("double", "decimal", "real", "numeric"), "number"),
    **dict.fromkeys(("arr", "tuple", "set"), "array"),
    "map": "object",
}
# a type name that starts with one of these, alone or followed by a digit, bracket or space
# ("int32", "list[str]"), means the target; "internal" or "list_price" do not
_PREFIXES = (
    (("int", "uint", "long", "short", "unsigned"), "integer"),
    (("num", "float"), "number"),
    (("list",), "array"),
    (("dict",), "object"),
)
_BOUNDARY = frozenset("0123456789[<( \t")
_NESTED_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_NESTED_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_NESTED_ONE = [
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
]


def _standard_type(raw: Any) -> Any:
    if not isinstance(raw, str) or raw in _STANDARD:
        return raw
    base = raw.split("(", 1)[0].strip().lower()  # varchar(255), decimal(10,2)
    if base in _STANDARD:
        return base
    if base in _ALIASES:
        return _ALIASES[base]
    for prefixes, target in _PREFIXES:
        for prefix in prefixes:
            if base == prefix or (
                len(base) > len(prefix)
                and base.startswith(prefix)
                and base[len(prefix)] in _BOUNDARY
            ):
                return target
    return raw


def normalize_schema_types(schema: Any) -> None:
    """Rewrite the schema's non-standard `type` values in place, at every nesting SGLang
    walks; unknown names stay as they are (the schema check then judges them)."""
    if isinstance(schema, list):
        for item in schema:
            normalize_schema_types(item)
        return
    if not isinstance(schema, dict):
        return
    kind = schema.get("type")
    if isinstance(kind, str):
        schema["type"] = _standard_type(kind)
    elif isinstance(kind, list):
        types: list[Any] = []
        for item in kind:
            mapped = _standard_type(item)
            if mapped not in types:
                types.append(mapped)
        schema["type"] = types
    for key in _NESTED_MAPS:
        if isinstance(schema.get(key), dict):
            for value in schema[key].values():
                normalize_schema_types(value)
    for key in _NESTED_LISTS:
        if isinstance(schema.get(key), list):
            for value in schema[key]:
                normalize_schema_types(value)
    for key in _NESTED_ONE:
        if key in schema:
            normalize_schema_types(schema[key])


def checked_parameters(parameters: Any, index: int, where: str) -> Any:
    """A tool's parameters rewritten as SGLang rewrites them; InputError (SGLang's 400) when
    they are not a JSON Schema. `index` counts the request's tools as SGLang's message does."""
    if parameters is None:
        return None
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        normalize_schema_types(parameters)
        Draft202012Validator.check_schema(parameters)
    except SchemaError as exc:
        raise InputError(
            f"{where}.parameters is not a valid JSON Schema (SGLang refuses tool {index}): "
            f"{exc.message}"
        ) from None
    except RecursionError:
        raise InputError(f"{where}.parameters is nested too deeply or holds a cycle") from None
    return parameters
