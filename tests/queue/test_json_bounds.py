"""jsonlimits.check: the JSON text it encodes anyway bounds the nesting (one opening bracket per
list or object), so only a text with more brackets than the limit is walked. Its answers must be
those of the walk-first check it replaced: the same refusals, with the same words, in the same order."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobqueue import jsonlimits
from jobqueue.jsonlimits import JSONLimitError


def walk_first(value, *, max_depth, max_bytes=None) -> None:
    """The check as it was: the depth walk first, then the encoding."""
    levels = jsonlimits.depth(value)
    if levels > max_depth:
        raise JSONLimitError(f"nested {levels} levels deep, more than the limit of {max_depth}")
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        raise JSONLimitError("holds NaN or Infinity, which JSON does not have") from None
    except TypeError as exc:
        raise JSONLimitError(f"not JSON: {exc}") from None
    if max_bytes is not None:
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise JSONLimitError(f"{size} bytes of JSON, more than the limit of {max_bytes}")


scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet="[]{}ab\x00\ud800", max_size=6) | st.just(frozenset({1}))  # a set is not JSON
)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3) | st.tuples(children) | st.dictionaries(st.text(max_size=3), children, max_size=3),
    max_leaves=10,
)


def answer(check, value, **bounds):
    try:
        check(value, **bounds)
    except JSONLimitError as exc:
        return str(exc)
    return None


@given(values, st.integers(0, 6), st.none() | st.integers(0, 60))
def test_check_refuses_what_the_walk_first_check_refused_with_the_same_words(value, max_depth, max_bytes):
    assert answer(jsonlimits.check, value, max_depth=max_depth, max_bytes=max_bytes) == answer(
        walk_first, value, max_depth=max_depth, max_bytes=max_bytes
    )


def test_check_answers_the_text_it_measured():
    assert jsonlimits.check({"a": ["é", "\x00"]}) == '{"a":["é","\\u0000"]}'


@pytest.mark.parametrize("levels", [33, 5000])
def test_a_deep_value_is_refused_for_its_depth_even_past_the_encoders_recursion(levels):
    value: list = [math.nan]
    for _ in range(levels - 1):
        value = [value, math.nan]
    with pytest.raises(JSONLimitError, match=f"nested {levels} levels deep"):
        jsonlimits.check(value)
