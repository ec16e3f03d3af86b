"""Group commit (jobqueue.groupcommit): the calls that threads make while a commit is
under way share the next one, each keeps its own answer, and nobody is answered
before the commit that holds its call.

The threads here have their own database connections, as the embedded worker's
do, so the tests run on a transactional database. Grouping is forced, not hoped
for: the first commit is held open (`before_commit`) until every other call has
queued behind it."""

import threading
import time

import pytest
from django.db import OperationalError, connection

from jobqueue import services
from jobqueue.clock import get_clock
from jobqueue.exceptions import StaleAttempt, Unavailable
from jobqueue.groupcommit import GroupCommitter
from jobqueue.models import Attempt, AttemptState, Job, JobEvent, JobState
from tests.factories import claim, enqueue_job, make_task, register
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 6


@pytest.fixture
def committer():
    return GroupCommitter()


def _claims(n: int):
    for _ in range(n):
        enqueue_job(make_task())
    worker = register(capacity=n)
    return claim(worker, max_jobs=n)


def _finish(committer: GroupCommitter, c, token=None):
    return committer.call(
        services.attempt_finish, attempt_id=c.attempt_id, token=token or c.token, outcome="succeeded", summary={}
    )


def _in_threads(calls) -> list:
    """Run each call on a thread of its own (own connection); their answers or errors, in order."""
    from django.db import connection

    answers: list = [None] * len(calls)

    def run(i, fn):
        try:
            answers[i] = fn()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            answers[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a caller never got its answer"
    return answers


class _HeldFirstCommit:
    """before_commit that holds the first commit until `others` more calls have queued behind it,
    and records each commit's size."""

    def __init__(self, committer: GroupCommitter, others: int):
        self.committer, self.others = committer, others
        self.sizes: list[int] = []

    def __call__(self, size: int) -> None:
        self.sizes.append(size)
        if len(self.sizes) == 1:
            for _ in range(3000):
                with self.committer._lock:
                    if len(self.committer._pending) >= self.others:
                        return
                threading.Event().wait(0.01)
            raise AssertionError("the other calls never queued")


def test_calls_made_during_a_commit_share_the_next_one_and_each_gets_its_own_answer(committer):
    claims = _claims(THREADS)
    held = committer.before_commit = _HeldFirstCommit(committer, THREADS - 1)
    first = threading.Thread(target=lambda: _in_threads([lambda: _finish(committer, claims[0])]))
    first.start()
    while not held.sizes:  # the first call is committing (held open) before the others call
        threading.Event().wait(0.005)
    answers = _in_threads([lambda c=c: _finish(committer, c) for c in claims[1:]])
    first.join(30)

    assert held.sizes == [1, THREADS - 1]  # two commits for six finishes
    assert answers == [JobState.SUCCEEDED] * (THREADS - 1)
    assert Job.objects.filter(state=JobState.SUCCEEDED).count() == THREADS


def test_a_refused_call_leaves_the_others_of_its_commit_written(committer):
    claims = _claims(3)
    held = committer.before_commit = _HeldFirstCommit(committer, 2)
    first = threading.Thread(target=lambda: _in_threads([lambda: _finish(committer, claims[0])]))
    first.start()
    while not held.sizes:
        threading.Event().wait(0.005)
    stale, good = _in_threads([lambda: _finish(committer, claims[1], token="not-the-token"), lambda: _finish(committer, claims[2])])
    first.join(30)

    assert held.sizes == [1, 2]
    assert isinstance(stale, StaleAttempt)
    assert good == JobState.SUCCEEDED
    states = dict(Attempt.objects.values_list("id", "state"))
    assert states[claims[1].attempt_id] == AttemptState.ACTIVE  # the refused one changed nothing
    assert states[claims[2].attempt_id] == AttemptState.SUCCEEDED


def test_a_commit_that_fails_answers_every_call_in_it_unavailable_and_writes_none(committer):
    claims = _claims(THREADS)
    held = _HeldFirstCommit(committer, THREADS - 1)

    def fail_second(size: int) -> None:
        held(size)
        if len(held.sizes) == 2:
            raise OperationalError("disk I/O error")  # what a failing COMMIT raises

    committer.before_commit = fail_second
    first = threading.Thread(target=lambda: _in_threads([lambda: _finish(committer, claims[0])]))
    first.start()
    while not held.sizes:
        threading.Event().wait(0.005)
    answers = _in_threads([lambda c=c: _finish(committer, c) for c in claims[1:]])
    first.join(30)

    assert held.sizes == [1, THREADS - 1]
    assert all(isinstance(a, Unavailable) for a in answers), answers
    assert Job.objects.filter(state=JobState.SUCCEEDED).count() == 1  # only the first commit's
    assert Attempt.objects.filter(state=AttemptState.ACTIVE).count() == THREADS - 1


def _writes_then_refuses(*, job_id: int):
    """A call that writes (an event row), then is refused: its write must not stay."""
    from jobqueue.services.common import event

    with connection.cursor() as cursor:
        event(cursor, job_id=job_id, kind="half-written", at=get_clock().now())
    raise StaleAttempt("refused after writing")


_writes_then_refuses.body = _writes_then_refuses


def _breaks_the_transaction(*, job_id: int):
    """What Django leaves when a savepoint cannot be rolled back (a lost connection, a full disk):
    the transaction is marked for rollback, and would end without a word."""
    connection.needs_rollback = True


_breaks_the_transaction.body = _breaks_the_transaction


def _grouped(committer, first, others) -> list:
    """`first` alone in a held-open commit, then `others` (callables) queued behind it: their answers."""
    held = committer.before_commit = _HeldFirstCommit(committer, len(others))
    lead = threading.Thread(target=lambda: _in_threads([first]))
    lead.start()
    while not held.sizes:
        threading.Event().wait(0.005)
    answers = _in_threads(others)
    lead.join(30)
    assert held.sizes[0] == 1  # the others queued behind it, together (a broken batch never reaches its COMMIT)
    return answers


def test_a_call_that_wrote_before_it_was_refused_leaves_no_write_and_the_others_commit(committer):
    claims = _claims(3)
    job_id = claims[1].job_id
    refused, good = _grouped(committer, lambda: _finish(committer, claims[0]), [
        lambda: committer.call(_writes_then_refuses, job_id=job_id), lambda: _finish(committer, claims[2]),
    ])  # fmt: skip
    assert isinstance(refused, StaleAttempt) and good == JobState.SUCCEEDED
    assert not JobEvent.objects.filter(kind="half-written").exists()
    assert Job.objects.filter(state=JobState.SUCCEEDED).count() == 2


def test_a_call_that_breaks_the_transaction_gets_every_call_of_its_commit_answered_unavailable(committer):
    claims = _claims(3)
    answers = _grouped(committer, lambda: _finish(committer, claims[0]), [
        lambda: _finish(committer, claims[1]), lambda: committer.call(_breaks_the_transaction, job_id=claims[2].job_id),
    ])  # fmt: skip
    assert all(isinstance(a, Unavailable) for a in answers), answers  # none answered as done: nothing of it stayed
    assert Job.objects.filter(state=JobState.SUCCEEDED).count() == 1


def test_deferred_calls_are_committed_and_flush_waits_for_them():
    (c,) = _claims(1)
    committer = GroupCommitter()
    _in_threads([lambda: (committer.defer(services.attempt_finish, attempt_id=c.attempt_id, token=c.token,
                                          outcome="succeeded"), committer.flush())])  # fmt: skip
    assert Job.objects.get().state == JobState.SUCCEEDED


class _CountedNotify:
    """The committer's condition, counting the wake-ups it is sent."""

    def __init__(self, condition: threading.Condition):
        self.condition, self.notified = condition, 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        self.condition.notify(n)

    def wait(self, timeout=None) -> bool:
        return self.condition.wait(timeout)


def test_a_deferred_call_wakes_no_one_and_rides_with_the_next_call_someone_waits_for():
    claims = _claims(2)
    committer = GroupCommitter(defer_seconds=3600)
    sizes = []
    committer.before_commit = sizes.append
    committer._ready = counted = _CountedNotify(committer._ready)

    def defer_then_call():
        committer.defer(services.attempt_finish, attempt_id=claims[0].attempt_id, token=claims[0].token, outcome="succeeded")
        assert counted.notified == 0 and sizes == []  # no commit of its own: it waits for company
        return _finish(committer, claims[1])

    assert _in_threads([defer_then_call]) == [JobState.SUCCEEDED]
    assert sizes == [2] and counted.notified == 1  # one commit, woken once, for both
    assert Job.objects.filter(state=JobState.SUCCEEDED).count() == 2


def test_a_deferred_call_that_no_call_joins_commits_alone_after_defer_seconds(monkeypatch):
    claims = _claims(2)
    monkeypatch.setattr(GroupCommitter, "IDLE_SECONDS", 60.0)  # far past the wait below: only a slice can end it
    committer = GroupCommitter(defer_seconds=0.05)
    assert _in_threads([lambda: _finish(committer, claims[0])]) == [JobState.SUCCEEDED]  # the thread now idles
    c = claims[1]
    _in_threads([lambda: committer.defer(services.attempt_finish, attempt_id=c.attempt_id, token=c.token, outcome="succeeded")])
    wait_for(lambda: Job.objects.filter(state=JobState.SUCCEEDED).count() == 2, timeout=5,
             what="the deferred finish, alone, within a slice of the idle wait")  # fmt: skip


def test_deferred_calls_left_over_from_a_full_batch_do_not_wait_again():
    from jobqueue.groupcommit import _Call

    committer = GroupCommitter(max_batch=2, defer_seconds=3600)
    committer._pending = [_Call(lambda: None, {}, waiting=False) for _ in range(3)]
    committer._deferred_at = time.monotonic() - 7200  # queued long ago: due
    with committer._lock:
        assert len(committer._take()) == 2
    taken = []

    def take_again():
        with committer._lock:
            taken.append(committer._take())

    second = threading.Thread(target=take_again, daemon=True)  # the old bookkeeping waited defer_seconds here
    second.start()
    second.join(10)
    assert taken and len(taken[0]) == 1  # due as long as the batch before it, not defer_seconds more


def _failing_commits(committer: GroupCommitter, failures: int) -> list[int]:
    """before_commit that fails the next `failures` commits as a failing COMMIT does; their sizes."""
    sizes: list[int] = []

    def before_commit(size: int) -> None:
        sizes.append(size)
        if len(sizes) <= failures:
            raise OperationalError("database is locked")

    committer.before_commit = before_commit
    return sizes


def test_a_deferred_call_of_a_commit_that_failed_goes_in_the_next_one(caplog):
    deferred, waited = _claims(2)
    committer = GroupCommitter(defer_seconds=3600)  # only a call someone waits for commits
    sizes = _failing_commits(committer, 1)

    def defer_then_call():
        committer.defer(services.attempt_finish, attempt_id=deferred.attempt_id, token=deferred.token, outcome="succeeded")
        with pytest.raises(Unavailable):  # its caller sends it again, when it will: nobody does for the deferred one
            _finish(committer, waited)
        committer.flush()

    _in_threads([defer_then_call])
    assert sizes == [2, 2]  # the failed commit's deferred call, in the flush's commit
    assert Job.objects.get(pk=deferred.job_id).state == JobState.SUCCEEDED
    assert Job.objects.get(pk=waited.job_id).state == JobState.LEASED
    assert "deferred attempt_finish failed" not in caplog.text  # it did not: the second commit holds it


def test_a_deferred_call_is_dropped_after_deferred_tries_failed_commits(caplog):
    from jobqueue.groupcommit import DEFERRED_TRIES

    (c,) = _claims(1)
    committer = GroupCommitter(defer_seconds=3600)
    sizes = _failing_commits(committer, DEFERRED_TRIES)

    def defer_then_flush():
        committer.defer(services.attempt_finish, attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
        for _ in range(DEFERRED_TRIES):
            with pytest.raises(Unavailable):
                committer.flush()
        committer.flush()  # commits: nothing is left of the deferred call to commit

    _in_threads([defer_then_flush])
    assert sizes == [2] * DEFERRED_TRIES + [1]
    assert Job.objects.get().state == JobState.LEASED
    assert "deferred attempt_finish failed" in caplog.text


def test_defer_seconds_must_be_positive():
    with pytest.raises(ValueError, match="defer_seconds"):
        GroupCommitter(defer_seconds=0)


def test_a_committer_idle_past_its_time_starts_again_with_the_next_call(monkeypatch):
    claims = _claims(2)
    committer = GroupCommitter()
    monkeypatch.setattr(GroupCommitter, "IDLE_SECONDS", 0.01)
    assert _in_threads([lambda: _finish(committer, claims[0])]) == [JobState.SUCCEEDED]
    for _ in range(500):  # the thread ends once idle
        if not any(t.name == "apiary-commit" and t.is_alive() for t in threading.enumerate()):
            break
        threading.Event().wait(0.01)
    assert _in_threads([lambda: _finish(committer, claims[1])]) == [JobState.SUCCEEDED]


def test_a_call_inside_the_callers_own_transaction_runs_there():
    from django.db import transaction

    (c,) = _claims(1)
    committer = GroupCommitter()
    committer.before_commit = lambda size: pytest.fail("no group commit inside the caller's transaction")
    with pytest.raises(RuntimeError), transaction.atomic():
        assert _finish(committer, c) == JobState.SUCCEEDED
        raise RuntimeError("roll back")  # the caller's transaction decides: nothing stays
    assert Job.objects.get().state == JobState.LEASED


def test_only_services_can_be_grouped():
    with pytest.raises(TypeError, match="not a queue service"):
        GroupCommitter().call(len, obj=())


def test_a_batch_runs_deferred_calls_first_then_a_services_waited_calls_together():
    from jobqueue.groupcommit import _by_body, _Call

    def finish(): ...
    def record(): ...
    def history(): ...

    f1, r1, f2, d1, f3, d2, d3, r2 = (
        _Call(finish, {"n": 1}, waiting=True), _Call(record, {}, waiting=True), _Call(finish, {"n": 2}, waiting=True),
        _Call(history, {"n": 1}, waiting=False), _Call(finish, {"n": 3}, waiting=True),
        _Call(history, {"n": 2}, waiting=False), _Call(history, {"n": 3}, waiting=False), _Call(record, {}, waiting=True),
    )  # fmt: skip
    # f3 may come from the thread that deferred d1 just before: it runs after d1 all the same. And no
    # deferred call can need f1, f2 or f3 before it: their callers still wait for them.
    assert _by_body([f1, r1, f2, d1, f3, d2, d3, r2]) == [(history, [d1, d2, d3]), (finish, [f1, f2, f3]), (record, [r1, r2])]
    # Deferred calls keep their order: only a run of one service's calls is grouped.
    d4 = _Call(record, {}, waiting=False)
    assert _by_body([d1, d4, d2]) == [(history, [d1]), (record, [d4]), (history, [d2])]


def test_a_call_on_an_attempt_stays_behind_an_earlier_call_on_it_and_so_does_all_after_it():
    from jobqueue.groupcommit import _by_body, _Call

    def finish(): ...
    def log(): ...
    def history(): ...

    # A job's finish queued behind its own last log chunk stays behind it.
    chunk = _Call(log, {"attempt_id": 2}, waiting=True)
    g1, g2 = _Call(finish, {"attempt_id": 1}, waiting=True), _Call(finish, {"attempt_id": 2}, waiting=True)
    assert _by_body([g1, chunk, g2]) == [(finish, [g1]), (log, [chunk]), (finish, [g2])]
    # A deferred chunk on an attempt that a waited call before it is about is not moved ahead of
    # that call; nor is any deferred call after it (its thread may have sent both).
    d1, late, d2 = _Call(history, {}, waiting=False), _Call(log, {"attempt_id": 1}, waiting=False), _Call(history, {}, waiting=False)
    assert _by_body([g1, d1, late, d2, g2]) == [(history, [d1]), (finish, [g1]), (log, [late]), (history, [d2]), (finish, [g2])]
    # On an attempt that no waited call before it is about, a deferred chunk goes first like any other.
    other = _Call(log, {"attempt_id": 3}, waiting=False)
    assert _by_body([g1, other, d1]) == [(log, [other]), (history, [d1]), (finish, [g1])]
