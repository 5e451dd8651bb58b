"""Where a recipe's validation errors are: the field path, the YAML line, the allowed keys.

pydantic reports a location such as ``steps.1.Step_quantize_static.options.mode``; this module
turns it into ``recipe.yaml:12: steps[1].options.mode: ...`` with the allowed values or keys,
and a did-you-mean for a misspelt key.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Annotated, Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from .options import NAME_PATTERN
from .registry import DATA_SOURCES, MODEL_SOURCES, PASSES


def format_errors(exc: ValidationError, raw: Any, node: Any, where: str, cls: type[BaseModel]) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        loc = _strip_tags(err["loc"], raw)
        field = _loc_str(loc)
        msg = err["msg"].removeprefix("Value error, ")
        ctx = err.get("ctx") or {}
        ref = _REF.match(msg) if not loc else None
        if ref:  # cross-field checks name their own field: "steps[1].from: ..."
            field, msg = ref.group(1), ref.group(2)
            loc = _parse_loc(field)
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            tag = "pass" if "pass" in str(ctx.get("discriminator")) else "source"
            loc = (*loc, tag)
            field = _loc_str(loc)
            allowed = str(ctx.get("expected_tags", "")).replace("'", "") or _tags(loc)
            if err["type"] == "union_tag_invalid":
                msg = f"unknown {tag} {ctx.get('tag')!r}; allowed: {allowed}"
            else:
                msg = f"required field is missing; allowed: {allowed}"
        elif err["type"] == "string_pattern_mismatch" and ctx.get("pattern") == NAME_PATTERN:
            msg = f"names may use letters, digits and _ . + - only (got {err['input']!r})"
        elif err["type"] == "extra_forbidden":
            allowed = _allowed_keys(cls, loc[:-1], raw)
            msg = f"unknown key {loc[-1]!r}"
            if allowed:
                close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
                msg += f" (did you mean {close[0]!r}?)" if close else ""
                msg += f"; allowed: {', '.join(allowed)}"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif ref is None and "input" in err and not isinstance(err["input"], dict | list):
            msg += f" (got {err['input']!r})"
        line = _line(node, loc)
        prefix = f"{where}:{line}" if line else where
        lines.append(f"{prefix}: {field or '(top level)'}: {msg}")
    head = lines[0]
    if len(lines) > 1:
        head += "".join(f"\n{x}" for x in lines[1:6])
        if len(lines) > 6:
            head += f"\n(+{len(lines) - 6} more)"
    return head


def _tags(loc: tuple[Any, ...]) -> str:
    reg = {"model": MODEL_SOURCES, "data": DATA_SOURCES, "steps": PASSES}.get(str(loc[0]))
    return ", ".join(reg.names()) if reg is not None else ""


_REF = re.compile(r"^([A-Za-z_][\w.\[\]]*): (.*)$", re.S)


def _parse_loc(text: str) -> tuple[Any, ...]:
    out: list[Any] = []
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", text):
        out.append(int(part[1:-1]) if part.startswith("[") else part)
    return tuple(out)


def _strip_tags(loc: tuple[Any, ...], raw: Any) -> tuple[Any, ...]:
    """Drop the discriminator tags pydantic puts in the location of union members."""
    out: list[Any] = []
    cur = raw
    for part in loc:
        if (
            isinstance(cur, dict)
            and isinstance(part, str)
            and part not in cur
            and (part in (cur.get("source"), cur.get("pass")) or part.startswith("Step_"))
        ):
            continue
        out.append(part)
        if isinstance(cur, dict):
            cur = cur.get(part)
        elif isinstance(cur, list) and isinstance(part, int) and part < len(cur):
            cur = cur[part]
        else:
            cur = None
    return tuple(out)


def _loc_str(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line(node: Any, loc: tuple[Any, ...]) -> int | None:
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == part:
                    node = value if part != loc[-1] else key
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return line
            node = node.value[part]
        else:
            return line
        line = node.start_mark.line + 1
    return line


def _allowed_keys(cls: Any, loc: tuple[Any, ...], raw: Any) -> list[str]:
    """Field names (by alias) of the model found at ``loc``, walking annotations."""
    tp: Any = cls
    cur = raw
    for part in loc:
        tp = _pick(tp, cur)
        if isinstance(tp, type) and issubclass(tp, BaseModel) and isinstance(part, str):
            fields = {(f.alias or n): f for n, f in tp.model_fields.items()}
            if part not in fields:
                return []
            tp = fields[part].annotation
        elif isinstance(part, int):
            args = typing.get_args(tp)
            tp = args[0] if args else Any
        cur = (
            cur.get(part)
            if isinstance(cur, dict)
            else (cur[part] if isinstance(cur, list) and isinstance(part, int) and part < len(cur) else None)
        )
    tp = _pick(tp, cur)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [f.alias or n for n, f in tp.model_fields.items()]
    return []


def _pick(tp: Any, value: Any) -> Any:
    """Resolve Annotated/Optional/union types to the member that fits ``value``."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = next((m for m in members if _tag_matches(m, value)), members[0] if members else Any)
        else:
            return tp


def _tag_matches(member: Any, value: Any) -> bool:
    """Whether ``value`` carries the discriminator (source / pass) of union member ``member``."""
    if not (isinstance(member, type) and issubclass(member, BaseModel) and isinstance(value, dict)):
        return False
    for tag in ("source", "pass_"):
        f = member.model_fields.get(tag)
        if f is not None and typing.get_args(f.annotation) == (value.get(f.alias or tag),):
            return True
    return False
