"""Plain Python functions as tool definitions: their JSON schemas, and the
check of a call's arguments against them.

A function's type hints become the JSON schema the model is shown (the
subset `schema_of` writes and `schema_problem` checks); its docstring is
the description, and the request parameters (`idempotency_key`,
`session_id`) are filled from the request, not by the model. Apart from the
server (keel_tools/server.py) because this is what a tool is, whoever
serves it; like the server, it depends on nothing of Keel's but the
generated contract.
"""

from __future__ import annotations

import inspect
import json
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from keel.tools.v1 import tools_pb2 as pb

# Parameters filled from the request rather than by the model.
REQUEST_PARAMETERS = frozenset({"idempotency_key", "session_id"})
_SIMPLE_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def schema_of(annotation: Any) -> dict[str, Any]:
    """The JSON schema of one type hint; TypeError for a hint with no JSON shape."""
    if annotation is Any or annotation is inspect.Parameter.empty:
        return {}
    if annotation is None or annotation is type(None):
        return {"type": "null"}
    if annotation in _SIMPLE_TYPES:
        return {"type": _SIMPLE_TYPES[annotation]}
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        schema = schema_of(args[0])
        notes = [note for note in args[1:] if isinstance(note, str)]
        return {**schema, "description": " ".join(notes)} if notes else schema
    if origin is Literal:
        schema = {"enum": list(args)}
        kinds = {_SIMPLE_TYPES.get(type(value)) for value in args}
        if len(kinds) == 1 and None not in kinds:
            schema["type"] = kinds.pop()
        return schema
    if origin is Union or origin is types.UnionType:
        return {"anyOf": [schema_of(arg) for arg in args]}
    if annotation is list or origin is list:
        return {"type": "array", "items": schema_of(args[0])} if args else {"type": "array"}
    if annotation is dict or origin is dict:
        if not args:
            return {"type": "object"}
        if args[0] is not str:
            raise TypeError(f"JSON object keys are strings, not {args[0]!r}")
        return {"type": "object", "additionalProperties": schema_of(args[1])}
    raise TypeError(f"no JSON schema for the type hint {annotation!r}")


@dataclass(frozen=True)
class ToolDefinition:
    """One function as a tool: what the model is told, and how to call it."""

    name: str
    description: str
    input_schema: Mapping[str, Any]
    function: Callable[..., Any]
    # The request parameters (idempotency_key, session_id) it takes.
    request_parameters: frozenset[str]

    def to_pb(self) -> pb.Tool:
        return pb.Tool(
            name=self.name,
            description=self.description,
            input_schema_json=json.dumps(self.input_schema),
        )


def define_tool(function: Callable[..., Any], name: str | None = None) -> ToolDefinition:
    """The tool made of `function`; TypeError when a parameter cannot be one
    a model fills in (no JSON shape, *args, positional-only)."""
    tool_name = name or function.__name__
    hints = get_type_hints(function, include_extras=True)
    properties: dict[str, Any] = {}
    required: list[str] = []
    request_parameters: set[str] = set()
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise TypeError(f"tool {tool_name}: *{parameter.name} cannot come from JSON")
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise TypeError(f"tool {tool_name}: {parameter.name} must be passable by name")
        if parameter.name in REQUEST_PARAMETERS:
            request_parameters.add(parameter.name)
            continue
        try:
            schema = schema_of(hints.get(parameter.name, inspect.Parameter.empty))
        except TypeError as exc:
            raise TypeError(f"tool {tool_name}, parameter {parameter.name}: {exc}") from None
        if parameter.default is parameter.empty:
            required.append(parameter.name)
        elif _is_json(parameter.default):
            schema = {**schema, "default": parameter.default}
        properties[parameter.name] = schema
    input_schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        input_schema["required"] = required
    return ToolDefinition(
        name=tool_name,
        description=inspect.getdoc(function) or "",
        input_schema=input_schema,
        function=function,
        request_parameters=frozenset(request_parameters),
    )


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
    "array": (list,),
    "object": (dict,),
}


def schema_problem(value: Any, schema: Mapping[str, Any], where: str) -> str | None:
    """Why `value` does not fit `schema` (the subset `schema_of` writes), or None."""
    if "anyOf" in schema:
        fits = any(schema_problem(value, option, where) is None for option in schema["anyOf"])
        return None if fits else f"{where}: {json.dumps(value)} fits none of the allowed types"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where}: {json.dumps(value)} is not one of {json.dumps(schema['enum'])}"
    kind = schema.get("type")
    if kind is None:
        return None
    # bool is an int to Python, never to JSON.
    if isinstance(value, bool) and kind in ("integer", "number"):
        return f"{where}: expected {kind}, got {json.dumps(value)}"
    if not isinstance(value, _JSON_TYPES[kind]):
        return f"{where}: expected {kind}, got {json.dumps(value)}"
    members: list[tuple[str, Any, Mapping[str, Any]]] = []
    if isinstance(value, list) and "items" in schema:
        members = [(f"{where}[{i}]", item, schema["items"]) for i, item in enumerate(value)]
    elif isinstance(value, dict) and "additionalProperties" in schema:
        inner = schema["additionalProperties"]
        members = [(f"{where}.{key}", item, inner) for key, item in value.items()]
    for path, item, item_schema in members:
        problem = schema_problem(item, item_schema, path)
        if problem:
            return problem
    return None


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def arguments_problem(tool: ToolDefinition, arguments: Mapping[str, Any]) -> str | None:
    """Why `arguments` do not fit the tool's schema, or None. The runner checks
    the schema too; this guards the function from any other caller."""
    properties: Mapping[str, Any] = tool.input_schema["properties"]
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        return "unknown arguments: " + ", ".join(unknown)
    missing = [name for name in tool.input_schema.get("required", ()) if name not in arguments]
    if missing:
        return "missing arguments: " + ", ".join(missing)
    for name, value in arguments.items():
        problem = schema_problem(value, properties[name], name)
        if problem:
            return problem
    return None
