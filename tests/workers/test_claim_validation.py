"""A remote worker checks every field of a claim before it runs anything
(workers/claimcheck.py), finishes a refused attempt `failed` with the reason
when its id and token are usable, and never builds a path from claim data
that resolves outside its state directory."""

import json
import logging
import os
import re
import threading

import pytest

from jobqueue.exceptions import InvalidRequest
from tests.test_executor import GRACE, make_claim, make_executor
from tests.test_http_transport import GOOD_JOB, Scripted, server, transport  # noqa: F401 - server is a fixture
from tests.workers.test_claim_backoff import ScriptedTransport, run_until, runtime_of
from workers import claimcheck
from workers.claimcheck import PathOutside, inside, inside_each

# (an override of a good job, the field its refusal names)
BAD_FIELDS = [
    ({"job_id": 2**63}, "job_id"),
    ({"attempt_number": 2**31}, "attempt_number"),
    ({"attempt_number": "../../../../outside/pwned"}, "attempt_number"),
    ({"agent": "../../elsewhere"}, "agent"),
    ({"agent": "sh\n2026-01-01 forged log line"}, "agent"),
    ({"runner": "a" * 129}, "runner"),
    ({"runner": ""}, "runner"),
    ({"lease_expires_at": "2030-01-01T00:00:00"}, "lease_expires_at"),  # no zone: cannot be placed in time
    ({"lease_expires_at": "2030-01-01T00:00:00Z" + " " * 100}, "lease_expires_at"),
    ({"task": {"id": 7, "deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}, "payload"),
    ({"task": {"id": 7, "n": float("nan")}}, "payload"),
]


class Recorded:
    """The scripted server's requests as (path, JSON body)."""

    def __init__(self):
        self.requests: list[tuple[str, dict]] = []

    def __enter__(self):
        real, requests = Scripted.do_POST, self.requests

        def do_post(handler):
            body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
            requests.append((handler.path, json.loads(body)))
            handler.headers.replace_header("Content-Length", "0")  # read already
            real(handler)

        self.real, Scripted.do_POST = real, do_post
        return self

    def __exit__(self, *exc):
        Scripted.do_POST = self.real


FINISHED = (200, "application/json", json.dumps({"job_state": "failed"}))


def claim_answer(*jobs) -> tuple[int, str, str]:
    return 200, "application/json", json.dumps({"jobs": list(jobs)})


@pytest.mark.parametrize("override, field", BAD_FIELDS, ids=lambda v: v if isinstance(v, str) else None)
def test_a_refused_claim_is_not_run_and_its_attempt_is_finished_failed_with_the_reason(server, override, field):  # noqa: F811
    bad = {**GOOD_JOB, "job_id": 9, "attempt_id": 3, **override}
    Scripted.answers = [claim_answer(bad, GOOD_JOB), FINISHED]
    with Recorded() as recorded:
        claims = transport(server).claim(session="s", max_jobs=2, wait=0)
    assert [c.job_id for c in claims] == [1]
    [(path, body)] = recorded.requests[1:]
    assert path == "/api/worker/v1/attempts/3/finish"
    assert (body["outcome"], body["token"]) == ("failed", GOOD_JOB["token"])
    assert body["error"].startswith(f"worker w1 refused the claim: {field}")


@pytest.mark.parametrize(
    "override", [{"token": "tok en"}, {"token": "t" * 257}, {"token": 12}, {"attempt_id": 0}, {"attempt_id": True}]
)
def test_without_a_usable_attempt_id_and_token_the_lease_is_left_to_run_out(server, override):  # noqa: F811
    Scripted.answers = [claim_answer({**GOOD_JOB, "job_id": 9, **override}, GOOD_JOB)]
    with Recorded() as recorded:
        claims = transport(server).claim(session="s", max_jobs=2, wait=0)
    assert [c.job_id for c in claims] == [1]
    assert [path for path, _ in recorded.requests] == ["/api/worker/v1/claims"]  # no finish sent
    with pytest.raises(claimcheck.ClaimRefused) as refused:
        claimcheck.claim_of({**GOOD_JOB, **override})
    assert "tok en" not in refused.value.reason  # a token is never quoted


def test_a_good_claim_passes_unchanged():
    claim = claimcheck.claim_of(GOOD_JOB)
    assert (claim.job_id, claim.attempt_id, claim.attempt_number, claim.agent, claim.runner) == (1, 2, 1, "sh", "shell")
    assert claim.payload == {"workflow": "triage", "instance_id": 5, "task": {"id": 7, "title": "x"}}


def test_the_probes_task_id_never_becomes_a_path(tmp_path):
    """The finding: `task.id: "../../../../elsewhere/ws"` in a claim answer."""
    executor = make_executor(tmp_path, "touch ran-here")
    outcome = executor.run(make_claim({"id": "../../../../elsewhere/ws", "title": "t"}), threading.Event(), grace=GRACE)
    assert outcome.outcome == "failed"
    assert not (tmp_path / "elsewhere").exists() and not list(tmp_path.rglob("ran-here"))


# --- paths from claim data -----------------------------------------------------------------------


@pytest.mark.parametrize("parts", [("..",), ("a/../..",), ("logs", "../../x"), ("",), ("x\0y",), ("/etc",)])
def test_a_path_part_that_is_not_one_plain_name_is_refused(tmp_path, parts):
    with pytest.raises(PathOutside):
        inside(tmp_path, *parts)


def test_a_path_through_a_symlink_out_of_the_state_directory_is_refused(tmp_path):
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    (state / "workspaces").mkdir(parents=True)
    elsewhere.mkdir()
    (state / "workspaces" / "7").symlink_to(elsewhere)
    with pytest.raises(PathOutside):
        inside(state, "workspaces", "7")
    assert inside(state, "workspaces", "8") == state / "workspaces" / "8"


def test_a_path_through_a_symlink_that_stays_in_the_state_directory_is_accepted(tmp_path):
    state = tmp_path / "state"
    (state / "elsewhere" / "7").mkdir(parents=True)
    (state / "workspaces").symlink_to(state / "elsewhere")
    assert inside(state, "workspaces", "7") == state / "workspaces" / "7"
    (state / "elsewhere" / "8").symlink_to(tmp_path)
    with pytest.raises(PathOutside):  # a link below a link is followed too
        inside(state, "workspaces", "8", "x")


def test_names_in_a_folder_are_checked_like_inside_and_looked_at_only_when_the_folder_is_there(tmp_path, monkeypatch):
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    (state / "logs").mkdir(parents=True)
    elsewhere.mkdir()
    with pytest.raises(PathOutside, match="not a plain"):
        inside_each(state, ("logs", "5"), ["a.log", "../x"])
    looked = []
    real_lstat = os.lstat
    monkeypatch.setattr(claimcheck.os, "lstat", lambda path: (looked.append(os.fspath(path)), real_lstat(path))[1])
    # logs/5 is not there: nothing below it can be a link, so its names are not looked at.
    assert inside_each(state, ("logs", "5"), ["a.log", "b.json"]) == (state / "logs" / "5", [state / "logs" / "5" / "a.log", state / "logs" / "5" / "b.json"])
    assert looked == [str(state / "logs"), str(state / "logs" / "5")]
    # There, each name is looked at, and one that leads outside is refused as inside() refuses it.
    (state / "logs" / "5").mkdir()
    (state / "logs" / "5" / "b.json").symlink_to(elsewhere / "b.json")
    assert inside_each(state, ("logs", "5"), ["a.log"])[1] == [state / "logs" / "5" / "a.log"]
    with pytest.raises(PathOutside, match="resolves outside"):
        inside_each(state, ("logs", "5"), ["a.log", "b.json"])


@pytest.mark.parametrize("linked", ["workspaces/7", "logs/5", "logs", "logs/5/s1.log", "logs/5/task-1.json", "logs/5/s1.checkpoint"])
def test_the_executor_runs_nothing_where_a_claim_path_leads_outside_its_state_directory(tmp_path, linked):
    executor = make_executor(tmp_path, "touch ran-here; echo x > \"$APIARY_TASK_FILE.copy\"")
    state, elsewhere = executor.config.state_dir, tmp_path / "elsewhere"
    elsewhere.mkdir()
    (state / linked).parent.mkdir(parents=True, exist_ok=True)
    (state / linked).symlink_to(elsewhere)
    outcome = executor.run(make_claim({"id": 7, "title": "t"}, instance=5), threading.Event(), grace=GRACE)
    assert outcome.outcome == "failed" and "resolves outside" in outcome.error
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize(
    ("answer", "got"),
    [({"jobs": "x"}, "its jobs is str"), ({"jobs": {"0": GOOD_JOB}}, "its jobs is dict"), ({}, "it has no jobs"),
     ([GOOD_JOB], "it is list")],
)
def test_a_claim_answer_that_is_not_an_object_with_a_list_of_jobs_is_an_invalid_request(server, answer, got):  # noqa: F811
    Scripted.answers = [(200, "application/json", json.dumps(answer))]
    with Recorded() as recorded, pytest.raises(InvalidRequest, match=re.escape(got)):
        transport(server).claim(session="s", max_jobs=2, wait=0)
    assert [path for path, _ in recorded.requests] == ["/api/worker/v1/claims"]  # nothing finished, nothing run


def test_the_claim_loop_logs_a_malformed_claim_answer_in_one_line_without_a_traceback(caplog):
    # The transport's own check of the answer (HttpTransport.claim calls claims_of on what it received).
    def claim(*, session, max_jobs, wait):
        transport._record("claim")
        return claimcheck.claims_of({"jobs": "x"})

    transport = ScriptedTransport()
    transport.claim = claim
    caplog.set_level(logging.INFO, logger="apiary.worker")
    assert run_until(runtime_of(transport), 1) == [0.5]  # backs off like any failed claim
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == (
        "worker w1: claim failed (POST claims: the answer is not an object with a list of jobs (its jobs is str)); "
        "claiming again in 0.50s"
    )
    assert record.exc_info is None and "Traceback" not in caplog.text
