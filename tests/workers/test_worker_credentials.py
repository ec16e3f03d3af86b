"""The remote worker's side of its identity, against a live control plane:
enrolment stores its credential (0600) and every later call uses it; a
restart registers with the stored credential (the shared token is not
needed, nor able, to register an enrolled id); a credential the control
plane forgot is replaced by enrolling again; a revoked one stops the worker
with the reason; an operator-issued credential is used as given."""

import stat

import pytest

from jobqueue import services
from jobqueue.exceptions import InvalidRequest
from jobqueue.models import Worker
from tests.api.conftest import CANARY
from tests.workers.connections import hang_up_all
from workers.credentials import CredentialElsewhere, CredentialFile
from workers.http import HttpTransport
from workers.transport import TransportError, Unauthorized, WorkerSpec

pytestmark = pytest.mark.django_db(transaction=True)

SPEC = WorkerSpec(worker_id="w1", pool=None, labels=(), capabilities=("apiary.workflow",), capacity=1)


@pytest.fixture(autouse=True)
def token(settings):
    settings.APIARY_WORKER_TOKEN = CANARY


@pytest.fixture
def connect(live_server, tmp_path):
    made = []

    def make(token: str = CANARY, *, stored: bool = True) -> HttpTransport:
        file = CredentialFile(tmp_path / "workers" / "w1.credential") if stored else None
        transport = HttpTransport(base_url=live_server.url, token=token, worker_id="w1", credential_file=file)
        made.append(transport)
        return transport

    yield make
    hang_up_all(made)


def stored(tmp_path) -> str:
    """The stored credential (the file's second line; its first is the control plane's URL)."""
    return (tmp_path / "workers" / "w1.credential").read_text().split()[1]


def test_enrolment_stores_the_credential_privately_and_every_later_call_uses_it(connect, tmp_path):
    transport = connect()
    registration = transport.register(SPEC)
    credential = stored(tmp_path)
    assert credential.startswith("apw_")
    assert stat.S_IMODE((tmp_path / "workers" / "w1.credential").stat().st_mode) == 0o600
    assert all(s.headers["Authorization"] == f"Bearer {credential}" for s in transport.sessions)
    assert transport.claim(session=registration.session, max_jobs=1, wait=0) == []  # the shared token could not


def test_a_restart_registers_with_the_stored_credential(connect, tmp_path):
    first = connect().register(SPEC)
    credential = stored(tmp_path)
    restarted = connect(token="not-the-shared-token-any-more-0123456789")  # it is not needed
    second = restarted.register(SPEC)
    assert second.session != first.session and stored(tmp_path) == credential
    assert Worker.objects.get(pk="w1").session == second.session


def test_a_forgotten_worker_comes_back_with_its_stored_credential(connect, tmp_path, clock):
    connect().register(SPEC)
    credential = stored(tmp_path)
    clock.advance(100)
    assert services.workers_forget(older_than=50) == 1  # it never ran a job: its registration is forgotten
    connect().register(SPEC)
    assert stored(tmp_path) == credential and Worker.objects.filter(pk="w1").exists()


def test_a_revoked_worker_stops_with_the_reason_and_never_sends_the_shared_token(connect, tmp_path, live_server):
    """A refused stored credential is final: the worker neither deletes it nor
    falls back to the shared token (a rogue control plane answering 401 would
    otherwise be handed the shared token)."""
    connect().register(SPEC)
    services.credentials_revoke(worker_id="w1")
    again = connect()
    sent = []
    for session in again.sessions:
        session.hooks["response"].append(lambda r, *a, **k: sent.append(r.request.headers["Authorization"]))
    with pytest.raises(Unauthorized, match="apiary worker token create w1"):
        again.register(SPEC)
    assert (tmp_path / "workers" / "w1.credential").exists()
    assert sent and all(CANARY not in header for header in sent), sent


def test_a_credential_is_sent_only_to_the_control_plane_that_issued_it(connect, tmp_path, live_server):
    connect().register(SPEC)
    with pytest.raises(CredentialElsewhere, match="delete it"):
        HttpTransport(base_url="http://127.0.0.1:9", token=CANARY, worker_id="w1",
                      credential_file=CredentialFile(tmp_path / "workers" / "w1.credential"))  # fmt: skip


def test_a_lost_enrolment_answer_is_retried_with_the_kept_key(connect, tmp_path, monkeypatch):
    """The first answer is lost after the control plane committed: the retry
    sends the same key (kept before the first try) and is answered again."""
    transport = connect()
    real = transport._call
    calls = []

    def lose_the_first_answer(*args, **kwargs):
        answer = real(*args, **kwargs)
        calls.append(args[2])
        if len(calls) == 1:
            raise TransportError("read timeout (the answer was lost)")
        return answer

    monkeypatch.setattr(transport, "_call", lose_the_first_answer)
    with pytest.raises(TransportError):
        transport.register(SPEC)
    assert (tmp_path / "workers" / "w1.enrolment").exists()
    transport.register(SPEC)  # the worker command's retry
    assert stored(tmp_path).startswith("apw_") and not (tmp_path / "workers" / "w1.enrolment").exists()


def test_a_malformed_credential_in_the_answer_is_refused_and_nothing_is_stored(tmp_path):
    transport = HttpTransport(base_url="http://cp", token=CANARY, worker_id="w1",
                              credential_file=CredentialFile(tmp_path / "workers" / "w1.credential"))  # fmt: skip
    answer = {"credential": "apw_\r\nX-Evil: 1", "session": "s", "lease_duration": 30, "heartbeat_interval": 10,
              "worker_timeout": 30}  # fmt: skip
    transport._register = lambda spec: answer
    with pytest.raises(InvalidRequest, match="no valid credential"):
        transport.register(SPEC)
    assert not (tmp_path / "workers" / "w1.credential").exists()
    assert all(s.headers["Authorization"] == f"Bearer {CANARY}" for s in transport.sessions)


def test_an_operator_issued_credential_is_used_and_kept_for_the_next_start(connect, tmp_path, queue_config):
    """How a worker's own credential rotates: the new one given on the command line wins over the
    stored one, and once it registered it is the stored one (a plain restart then uses it)."""
    connect().register(SPEC)
    old = stored(tmp_path)
    queue_config(enrollment=False)
    _, secret = services.credential_issue(worker_id="w1")
    transport = connect(token=secret)
    registration = transport.register(SPEC)
    assert transport.claim(session=registration.session, max_jobs=1, wait=0) == []
    assert stored(tmp_path) == secret != old
    services.credentials_revoke(worker_id="w1", keep_newest=True)  # the rotation's end
    connect(token="the-shared-token-is-not-needed-0123456789").register(SPEC)  # a plain restart
