"""The text the queue's statements store, made without Django's adapters: a datetime as
Django's SQLite adapter writes it (sql.ts), a JSON value with NUL and lone surrogates
replaced as `clean` replaces them (sql.js). Their fast paths must write the same text."""

import datetime as dt
import json
import zoneinfo

import pytest
from django.db import connection
from hypothesis import given
from hypothesis import strategies as st

from jobqueue import sql
from jobqueue.text import clean

# Text with what clean replaces (NUL, lone surrogates), what must stay (an emoji, a backslash
# before a `u`, the escapes' look-alikes) and anything else.
texts = st.one_of(
    st.text(alphabet=st.characters(codec=None, exclude_categories=())),
    st.sampled_from(["\x00", "\ud800", "a\udfffb", "😀", "\\u0000", "\\ud83d", "C:\\udir", ""]),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | texts,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=12,
)


@given(json_values)
def test_js_writes_what_clean_and_dumps_write(value):
    assert sql.js(value) == json.dumps(clean(value), separators=(",", ":"))


def test_js_replaces_nul_and_lone_surrogates_and_keeps_the_rest():
    value = {"a\x00": ["x\ud800y", "😀", "\\u0000"], "k": 1}
    assert json.loads(sql.js(value)) == {"a\ufffd": ["x\ufffdy", "😀", "\\u0000"], "k": 1}


ZONES = [dt.UTC, dt.timezone(dt.timedelta(hours=-5)), zoneinfo.ZoneInfo("Europe/Paris")]
moments = st.datetimes(
    min_value=dt.datetime(2000, 1, 1), max_value=dt.datetime(2100, 1, 1), timezones=st.sampled_from(ZONES)
)


@pytest.mark.skipif(connection.vendor != "sqlite", reason="on PostgreSQL ts passes the datetime itself")
@given(moments)
def test_ts_writes_what_djangos_sqlite_adapter_writes(moment):
    assert sql.ts(moment) == connection.ops.adapt_datetimefield_value(moment)
