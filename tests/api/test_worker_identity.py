"""Worker identity over the protocol (README "Security"): the shared token
only enrols, each worker acts with its own credential and only as its own
id, `embedded` is reserved, revocation and rotation work, and what a worker
may say of itself at registration is bounded. Every refusal changes nothing.

The probe's findings, each a row here: re-registering a running worker's id
with the shared token (the takeover), registering `embedded`, a capacity of
a billion and thousands of labelled registrations, a rotation that stopped
running workers.
"""

import logging

import pytest

from jobqueue import services
from jobqueue.exceptions import ReservedWorkerId
from jobqueue.models import Attempt, AttemptState, JobState, Worker, WorkerCredential
from jobqueue.types import MAX_CAPABILITIES, MAX_CAPACITY, MAX_LABELS, MAX_NAME_LENGTH, hash_token
from tests.api.conftest import CANARY, credential_for
from tests.factories import claim, enqueue, register

pytestmark = pytest.mark.django_db

OLD = "old-shared-token-0123456789abcdefghijkl"  # ≥ 32 characters, as previous_worker_tokens requires


def error(response) -> dict:
    return response.json()["error"]


def enrol(api, worker_id: str, **fields):
    body = {"worker_id": worker_id, "capacity": 1, **fields}
    return api.post("workers/register", body, token=CANARY)


# --------------------------------------------------------------------------- enrolment


def test_enrolment_with_the_shared_token_issues_a_credential_kept_only_as_a_digest(api, clock):
    answer = enrol(api, "new-1")
    assert answer.status_code == 200
    credential = answer.json()["credential"]
    assert credential.startswith("apw_") and len(credential) >= 40
    [row] = WorkerCredential.objects.filter(worker_id="new-1")
    assert row.digest == hash_token(credential) and credential not in repr(row.__dict__)
    assert row.issued_by == "enrollment"
    again = api.post("workers/register", {"worker_id": "new-1", "capacity": 1}, token=credential)
    assert again.status_code == 200 and again.json()["credential"] is None  # a restart: no new credential


def test_the_shared_token_cannot_take_over_a_running_worker(api, world, unchanged):
    """The probe's takeover: register a running worker's id with the shared token.
    Refused; the victim's session and attempts are untouched."""
    with unchanged():
        answer = enrol(api, world.worker_id)
    assert answer.status_code == 403 and error(answer)["code"] == "credential_required"
    assert Worker.objects.get(pk=world.worker_id).session == world.session
    assert set(Attempt.objects.values_list("state", flat=True)) == {AttemptState.ACTIVE}


def test_a_live_worker_without_a_credential_is_not_taken_over_either(api, clock, unchanged):
    worker = register("legacy")  # registered before credentials existed: no credential row
    with unchanged():
        answer = enrol(api, "legacy")
    assert answer.status_code == 403 and error(answer)["code"] == "credential_required"
    assert "live process" in error(answer)["message"]
    clock.advance(31)  # silent past worker_timeout: the id is free for an enrolment
    assert enrol(api, "legacy").status_code == 200
    assert Worker.objects.get(pk="legacy").session != worker.session


def test_an_enrolled_worker_needs_its_credential_even_when_silent(api, clock, unchanged):
    credential = enrol(api, "quiet").json()["credential"]
    assert api.post("workers/register", {"worker_id": "quiet", "capacity": 1}, token=credential).status_code == 200
    clock.advance(3600)
    with unchanged():
        answer = enrol(api, "quiet")
    assert answer.status_code == 403 and error(answer)["code"] == "credential_required"


@pytest.mark.parametrize("token", ["shared", "credential"])
def test_embedded_is_reserved(api, clock, unchanged, token):
    """Registering `embedded` remotely made `apiary run` exit; it is refused, whoever asks."""
    services.worker_register(worker_id="embedded", embedded=True, capacity=1)
    secret = CANARY if token == "shared" else credential_for("w-other")
    with unchanged():
        answer = api.post("workers/register", {"worker_id": "embedded", "capacity": 1}, token=secret)
    assert answer.status_code == 403
    assert error(answer)["code"] == ("reserved_worker_id" if token == "shared" else "worker_mismatch")
    with pytest.raises(ReservedWorkerId):
        services.credential_issue(worker_id="embedded")


def test_enrolment_can_be_closed_and_operators_issue_credentials(api, clock, queue_config, unchanged):
    queue_config(enrollment=False)
    with unchanged():
        answer = enrol(api, "late")
    assert answer.status_code == 403 and error(answer)["code"] == "enrollment_closed"
    assert "apiary worker token create late" in error(answer)["message"]
    _, secret = services.credential_issue(worker_id="late")
    answer = api.post("workers/register", {"worker_id": "late", "capacity": 1}, token=secret)
    assert answer.status_code == 200


# --------------------------------------------------------------------------- acting as another worker


def test_a_credential_acts_only_as_its_own_worker(api, world, clock, unchanged):
    """Another worker's credential can register, heartbeat, claim, beat or finish nothing of w1's."""
    other = credential_for("w2")
    a = world.attempts[0]
    calls = [
        ("workers/register", {"worker_id": world.worker_id, "capacity": 1}),
        (f"workers/{world.worker_id}/heartbeat", {"session": world.session}),
        ("claims", {"worker_id": world.worker_id, "session": world.session}),
        (f"attempts/{a.attempt_id}/heartbeat", {"token": a.token}),
        (f"attempts/{a.attempt_id}/finish", {"token": a.token, "outcome": "succeeded", "summary": {"forged": 1}}),
    ]
    for path, body in calls:
        with unchanged():
            answer = api.post(path, body, token=other)
        assert answer.status_code == 403 and error(answer)["code"] == "worker_mismatch", path


def test_the_shared_token_cannot_act_as_a_worker(api, world, unchanged):
    a = world.attempts[0]
    calls = [
        (f"workers/{world.worker_id}/heartbeat", {"session": world.session}),
        ("claims", {"worker_id": world.worker_id, "session": world.session}),
        (f"attempts/{a.attempt_id}/heartbeat", {"token": a.token}),
        (f"attempts/{a.attempt_id}/finish", {"token": a.token, "outcome": "succeeded"}),
    ]
    for path, body in calls:
        with unchanged():
            answer = api.post(path, body, token=CANARY)
        assert answer.status_code == 403 and error(answer)["code"] == "credential_required", path
    assert api.get("status", token=CANARY).status_code == 200  # it still reads status


# --------------------------------------------------------------------------- revocation and rotation


def test_a_revoked_worker_is_refused_its_jobs_go_back_and_it_cannot_enrol_again(api, world, clock):
    services.credentials_revoke(worker_id=world.worker_id)
    old = credential_for(world.worker_id)
    answer = api.post(f"workers/{world.worker_id}/heartbeat", {"session": world.session}, token=old)
    assert answer.status_code == 401
    assert {a.job.state for a in Attempt.objects.select_related("job")} == {JobState.QUEUED}
    answer = enrol(api, world.worker_id)
    assert answer.status_code == 403 and error(answer)["code"] == "credential_revoked"
    _, fresh = services.credential_issue(worker_id=world.worker_id)  # the operator admits it again
    assert api.post("workers/register", {"worker_id": world.worker_id, "capacity": 1}, token=fresh).status_code == 200


def test_a_worker_credential_rotates_with_an_overlap(api, world, clock):
    old = credential_for(world.worker_id)
    _, new = services.credential_issue(worker_id=world.worker_id)
    beat = (f"workers/{world.worker_id}/heartbeat", {"session": world.session})
    assert api.post(*beat, token=old).status_code == 200  # both valid during the overlap
    assert api.post(*beat, token=new).status_code == 200
    services.credentials_revoke(worker_id=world.worker_id, keep_newest=True)
    assert api.post(*beat, token=old).status_code == 401
    assert api.post(*beat, token=new).status_code == 200
    assert set(Attempt.objects.values_list("state", flat=True)) == {AttemptState.ACTIVE}  # no job stopped


def test_previous_shared_tokens_enrol_during_a_rotation_and_are_logged_as_old(api, clock, settings, logs, monkeypatch):
    from jobqueue.api import auth

    monkeypatch.setattr(auth, "_old_logged", {})  # its once-a-minute memory, fresh for this test
    settings.APIARY_PREVIOUS_WORKER_TOKENS = (OLD,)
    assert enrol(api, "on-current").status_code == 200  # the current token still works
    answer = api.post("workers/register", {"worker_id": "on-old", "capacity": 1}, token=OLD)
    assert answer.status_code == 200
    old_lines = [r for r in logs if r.levelno == logging.WARNING and "previous_worker_tokens[0]" in r.getMessage()]
    assert old_lines and OLD not in old_lines[0].getMessage()
    settings.APIARY_PREVIOUS_WORKER_TOKENS = ()  # the rotation is finished
    assert api.post("workers/register", {"worker_id": "on-old-2", "capacity": 1}, token=OLD).status_code == 401


# --------------------------------------------------------------------------- bounds


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("capacity", 1_000_000_000),
        ("capacity", MAX_CAPACITY + 1),
        ("labels", [f"l{i}" for i in range(MAX_LABELS + 1)]),
        ("capabilities", [f"c{i}" for i in range(MAX_CAPABILITIES + 1)]),
        ("labels", ["x" * (MAX_NAME_LENGTH + 1)]),
        ("pool", "p" * (MAX_NAME_LENGTH + 1)),
    ],
    ids=["capacity-billion", "capacity-over", "labels-many", "capabilities-many", "label-long", "pool-long"],
)
def test_registration_is_bounded_naming_the_field(api, clock, unchanged, field, value):
    with unchanged():
        answer = enrol(api, "big", **{field: value})
    assert answer.status_code == 400 and field in error(answer)["details"], answer.json()


def test_the_largest_allowed_registration_is_accepted(api, clock):
    answer = enrol(
        api,
        "roomy",
        capacity=MAX_CAPACITY,
        labels=[f"l{i}" for i in range(MAX_LABELS)],
        capabilities=[f"c{i}" for i in range(MAX_CAPABILITIES)],
    )
    assert answer.status_code == 200


def test_silent_workers_that_never_ran_a_job_are_forgotten_and_keep_their_credentials(api, clock):
    enqueue()
    busy = register("has-history")
    claim(busy)
    register("idle-1")
    _, secret = services.credential_issue(worker_id="idle-1")
    clock.advance(100)
    register("recent")
    assert services.workers_forget(older_than=50) == 1  # idle-1 only: the others ran a job or spoke lately
    assert set(Worker.objects.values_list("worker_id", flat=True)) == {"has-history", "recent"}
    # Its credential stays: when it comes back it registers with it, as after any restart.
    answer = api.post("workers/register", {"worker_id": "idle-1", "capacity": 1}, token=secret)
    assert answer.status_code == 200


def test_a_lost_enrolment_answer_is_answered_again_for_the_same_key(api, clock, unchanged):
    """The answer is the only copy of the credential: when it is lost (a timeout,
    a proxy's 502) the worker asks again with the key it kept, and gets one."""
    key = "k" * 43
    first = enrol(api, "lossy", enrollment_key=key)
    assert first.status_code == 200  # ...but suppose it never arrived
    again = enrol(api, "lossy", enrollment_key=key)
    assert again.status_code == 200 and again.json()["credential"] != first.json()["credential"]
    assert api.post("workers/register", {"worker_id": "lossy", "capacity": 1}, token=first.json()["credential"]).status_code == 401
    with unchanged():
        other_key = enrol(api, "lossy", enrollment_key="o" * 43)  # not the worker that enrolled
    assert other_key.status_code == 403 and error(other_key)["code"] == "credential_required"
    credential = again.json()["credential"]
    session = again.json()["session"]
    assert api.post("workers/lossy/heartbeat", {"session": session}, token=credential).status_code == 200
    with unchanged():
        late = enrol(api, "lossy", enrollment_key=key)  # used since (any call): the key opens nothing any more
    assert late.status_code == 403 and error(late)["code"] == "credential_required"


def test_an_old_worker_that_ignores_its_credential_keeps_working_and_enrols_once_upgraded(api, clock):
    """A worker from before this version registers again (a restart): it is given a
    credential it does not know to use. It goes on with the shared token, and once
    upgraded (stopped, then started with the new code) it enrols with its key."""
    old = enrol(api, "old-timer")
    assert old.status_code == 200  # a credential it ignores
    beat = api.post("workers/old-timer/heartbeat", {"session": old.json()["session"]}, token=CANARY)
    assert beat.status_code == 200
    clock.advance(31)  # stopped for the upgrade, past worker_timeout
    upgraded = enrol(api, "old-timer", enrollment_key="u" * 43)
    assert upgraded.status_code == 200 and upgraded.json()["credential"]


def test_the_shared_token_never_acts_as_embedded(api, clock):
    embedded = services.worker_register(worker_id="embedded", embedded=True, capacity=1)
    answer = api.post("workers/embedded/heartbeat", {"session": embedded.session}, token=CANARY)
    assert answer.status_code == 403 and error(answer)["code"] == "reserved_worker_id"


def test_a_worker_enrolled_before_credentials_keeps_its_session_with_the_shared_token(api, clock, queue_config):
    """An id that never had a credential (a worker running since before this
    version) keeps heartbeating, claiming and finishing with the shared token,
    while enrolment is open, so upgrading the control plane stops no job."""
    enqueue()
    legacy = register("legacy")
    beat = ("workers/legacy/heartbeat", {"session": legacy.session})
    assert api.post(*beat, token=CANARY).status_code == 200
    [job] = api.post("claims", {"worker_id": "legacy", "session": legacy.session}, token=CANARY).json()["jobs"]
    finish = api.post(f"attempts/{job['attempt_id']}/finish", {"token": job["token"], "outcome": "succeeded"}, token=CANARY)
    assert finish.status_code == 200
    queue_config(enrollment=False)  # closed: the shared token acts for nobody
    closed = api.post(*beat, token=CANARY)
    assert closed.status_code == 403 and error(closed)["code"] == "credential_required"


# --------------------------------------------------------------------------- the claim budget


def test_claims_over_the_budget_are_answered_429_and_others_are_not_slowed(api, clock, queue_config, monkeypatch):
    from jobqueue.api import throttle

    queue_config(claim_rate=2.0, claim_burst=3)
    now = [1000.0]
    monkeypatch.setattr(throttle.claims, "timer", lambda: now[0])
    throttle.claims.clear()
    greedy, other = register("greedy"), register("other")
    body = {"worker_id": "greedy", "session": greedy.session, "wait": 0}
    statuses = [api.post("claims", body).status_code for _ in range(5)]
    assert statuses == [200, 200, 200, 429, 429]
    limited = api.post("claims", body)
    assert error(limited)["code"] == "rate_limited" and int(limited.headers["Retry-After"]) >= 1
    assert api.post("claims", {"worker_id": "other", "session": other.session, "wait": 0}).status_code == 200
    now[0] += 0.5  # one claim's worth of budget back at 2 per second
    assert api.post("claims", body).status_code == 200
    assert api.post("claims", body).status_code == 429
    throttle.claims.clear()


def test_under_the_listener_a_claim_over_budget_is_answered_only_after_its_retry_after(
    clock, queue_config, monkeypatch, settings
):
    """A hostile loop that ignores Retry-After gets one refusal per connection per
    Retry-After, not as many as it can send: the listener holds the 429 that long
    (a coroutine's wait, no thread)."""
    from jobqueue.api import asgi, throttle
    from tests.api.conftest import AsgiApi

    settings.APIARY_WORKER_TOKEN = CANARY
    api = AsgiApi(monkeypatch)
    held = []

    async def hold(seconds):
        held.append(seconds)

    monkeypatch.setattr(asgi, "_hold", hold)
    queue_config(claim_rate=0.5, claim_burst=1)
    monkeypatch.setattr(throttle.claims, "timer", lambda: 5000.0)
    throttle.claims.clear()
    greedy = register("greedy")
    body = {"worker_id": "greedy", "session": greedy.session, "wait": 0}
    assert api.post("claims", body).status_code == 200
    refused = api.post("claims", body)
    assert refused.status_code == 429 and held == [float(refused.headers["Retry-After"])] == [2.0]
    throttle.claims.clear()
