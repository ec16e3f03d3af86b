"""A remote worker checks every field of a journal answer (workers/recordcheck.py)
before it believes a record: a broken or hostile control plane's answer is an
InvalidRequest naming the field, never a traceback and never a Record."""

import json

import pytest

from jobqueue.exceptions import InvalidRequest
from tests import test_http_transport
from tests.test_http_transport import Scripted, transport

server = test_http_transport.server  # the scripted control plane (a fixture)

GOOD = {
    "key": "publish:open-pr", "state": "done", "value": {"output": "ok"}, "attempt_number": 2,
    "started_by": 1, "started_earlier": True, "already_done": False,
}  # fmt: skip


def answer(body) -> tuple[int, str, str]:
    return 200, "application/json", json.dumps(body)


def write(t, state="done"):
    return t.record(attempt_id=1, token="x", key="publish:open-pr", state=state, value={"output": "ok"})


def test_a_good_answer_is_a_record(server):
    Scripted.answers = [answer({"record": GOOD}), answer({"records": [GOOD, {**GOOD, "key": "step:plan"}]})]
    t = transport(server)
    record = write(t)
    assert (record.key, record.state, record.value, record.started_earlier) == ("publish:open-pr", "done", {"output": "ok"}, True)
    assert [r.key for r in t.records(attempt_id=1, token="x")] == ["publish:open-pr", "step:plan"]


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ([], "record"),
        ({"records": [GOOD]}, "record"),
        ({"record": "done"}, "JSON object"),
        ({"record": {**GOOD, "key": "publish:other"}}, "key"),
        ({"record": {**GOOD, "key": 7}}, "key"),
        ({"record": {**GOOD, "state": "started"}}, "state"),  # `done` was written: a done record is final
        ({"record": {**GOOD, "state": "finished"}}, "state"),
        ({"record": {**GOOD, "value": "ok"}}, "value"),
        ({"record": {**GOOD, "value": {"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}}, "value"),
        ({"record": {**GOOD, "value": {"big": "x" * 70000}}}, "value"),
        ({"record": {**GOOD, "attempt_number": True}}, "attempt_number"),
        ({"record": {**GOOD, "attempt_number": 0}}, "attempt_number"),
        ({"record": {**GOOD, "started_by": "1"}}, "started_by"),
        ({"record": {**GOOD, "already_done": 1}}, "already_done"),
        ({"record": {**GOOD, "started_earlier": False}}, "started_earlier"),
        ({"record": {k: v for k, v in GOOD.items() if k != "attempt_number"}}, "attempt_number"),
    ],
)
def test_a_hostile_write_answer_is_refused_naming_the_field(server, body, names):
    Scripted.answers = [answer(body)]
    with pytest.raises(InvalidRequest, match=names) as refused:
        write(transport(server))
    assert refused.value.message.startswith("POST records:")


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"record": GOOD}, "list of records"),
        ({"records": "all"}, "list of records"),
        ({"records": [GOOD, GOOD]}, "twice"),
        ({"records": [GOOD, {**GOOD, "key": ""}]}, "key"),
        ({"records": [None]}, "JSON object"),
    ],
)
def test_a_hostile_list_answer_is_refused(server, body, names):
    Scripted.answers = [answer(body)]
    with pytest.raises(InvalidRequest, match=names):
        transport(server).records(attempt_id=1, token="x")


def test_a_started_write_may_find_the_record_done(server):
    Scripted.answers = [answer({"record": {**GOOD, "already_done": True}})]
    record = write(transport(server), state="started")
    assert record.state == "done" and record.already_done
