"""The remote worker's side of its identity, against a live control plane:
enrolment stores its credential (0600) and every later call uses it; a
restart registers with the stored credential (the shared token is not
needed, nor able, to register an enrolled id); a credential the control
plane forgot is replaced by enrolling again; a revoked one stops the worker
with the reason; an operator-issued credential is used as given."""

import stat

import pytest

from jobqueue import services
from jobqueue.exceptions import CredentialRevoked
from jobqueue.models import Worker, WorkerCredential
from tests.api.conftest import CANARY
from tests.workers.connections import hang_up_all
from workers.credentials import CredentialFile
from workers.http import HttpTransport
from workers.transport import WorkerSpec

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
    return (tmp_path / "workers" / "w1.credential").read_text().strip()


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


def test_a_forgotten_credential_is_replaced_by_enrolling_again(connect, tmp_path, clock):
    connect().register(SPEC)
    old = stored(tmp_path)
    clock.advance(100)
    assert services.workers_forget(older_than=50) == 1  # it never ran a job: forgotten, credential too
    connect().register(SPEC)
    assert stored(tmp_path) != old and WorkerCredential.objects.filter(worker_id="w1").count() == 1


def test_a_revoked_worker_stops_with_the_reason(connect, tmp_path):
    connect().register(SPEC)
    services.credentials_revoke(worker_id="w1")
    with pytest.raises(CredentialRevoked, match="revoked"):
        connect().register(SPEC)
    assert not (tmp_path / "workers" / "w1.credential").exists()  # nothing stale left to retry with


def test_an_operator_issued_credential_is_used_as_given_and_not_stored(connect, tmp_path, queue_config):
    queue_config(enrollment=False)
    _, secret = services.credential_issue(worker_id="w1")
    transport = connect(token=secret)
    registration = transport.register(SPEC)
    assert transport.claim(session=registration.session, max_jobs=1, wait=0) == []
    assert not (tmp_path / "workers" / "w1.credential").exists()
