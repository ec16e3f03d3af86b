"""Bounds on JSON documents that come from outside: nesting depth, size, and
the constants (NaN, ±Infinity) that JSON does not have.

Python's `json` accepts `NaN` and `Infinity` (neither SQLite's JSON_VALID nor
PostgreSQL's jsonb does) and recurses once per nesting level (a few thousand
levels raise RecursionError, not ValueError). `loads` refuses both with a
ValueError; `check` bounds a value that is already parsed. No database and
no DRF here: the protocol's parser (jobqueue/api/parsers.py), the workflow
payload (workflows/payload.py) and the remote worker's claim check share these.
"""

import json
import math
from typing import Any

MAX_DEPTH = 32  # protocol documents nest a few levels; summaries and payloads get room to spare


class JSONLimitError(ValueError):
    """A JSON document over a bound, or with a value JSON does not have."""


def reject_constant(name: str):
    raise JSONLimitError(f"{name} is not valid JSON")


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONLimitError(f"number {text[:20]}… is out of range")
    return value


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH, max_bytes: int | None = None) -> Any:
    """Parse `text`; JSONLimitError (a ValueError) for malformed JSON, NaN or
    ±Infinity, more than `max_bytes` or nesting deeper than `max_depth`."""
    size = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if max_bytes is not None and size > max_bytes:
        raise JSONLimitError(f"{size} bytes of JSON, more than the limit of {max_bytes}")
    try:
        value = json.loads(text, parse_constant=reject_constant, parse_float=finite_float)
    except RecursionError:
        raise JSONLimitError(f"JSON nested deeper than {max_depth} levels") from None
    except JSONLimitError:
        raise
    except json.JSONDecodeError as exc:  # says where, never quotes the text
        raise JSONLimitError(f"not valid JSON: {exc}") from None
    except ValueError as exc:  # an integer beyond sys.get_int_max_str_digits()
        reason = "an integer with too many digits" if "integer string conversion" in str(exc) else str(exc)
        raise JSONLimitError(f"not valid JSON: {reason}") from None
    check(value, max_depth=max_depth)
    return value


def depth(value: Any) -> int:
    """Nesting levels of containers (a scalar is 0, `{}` and `[1]` are 1), counted
    without recursion: the value may be hostile."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def check(value: Any, *, max_depth: int = MAX_DEPTH, max_bytes: int | None = None) -> str:
    """JSONLimitError when `value` nests deeper than `max_depth`, holds a float
    JSON cannot write, or encodes to more than `max_bytes` of JSON; else its JSON
    text (not ASCII-escaped: a NUL shows as `\\u0000`, a lone surrogate as itself)."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except (ValueError, TypeError, RecursionError) as exc:
        _within(value, max_depth)  # the depth is what such a value is refused for first
        if isinstance(exc, TypeError):
            raise JSONLimitError(f"not JSON: {exc}") from None
        if isinstance(exc, RecursionError):
            raise
        raise JSONLimitError("holds NaN or Infinity, which JSON does not have") from None
    # Every list and object writes one opening bracket (a bracket in a string only adds to the
    # count), so a text with no more of them than the limit nests no deeper: no walk needed.
    if text.count("[") + text.count("{") > max_depth:
        _within(value, max_depth)
    if max_bytes is not None:
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise JSONLimitError(f"{size} bytes of JSON, more than the limit of {max_bytes}")
    return text


def _within(value: Any, max_depth: int) -> None:
    levels = depth(value)
    if levels > max_depth:
        raise JSONLimitError(f"nested {levels} levels deep, more than the limit of {max_depth}")
