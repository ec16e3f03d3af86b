"""The notifier (jobqueue.wakeup.notifier): who is woken by which wake, in
what order, and when a worker may skip its first claim. Pure Python: no
database, no threads, a fake monotonic clock."""

import pytest

from jobqueue.wakeup.notifier import Notifier, Waiter, Wake

ANY = (None, frozenset(), frozenset())
GPU = (None, frozenset(), frozenset({"gpu"}))
POOL_A = ("a", frozenset(), frozenset())

CLASSES = {1: ANY, 2: GPU, 3: POOL_A}  # requirement set id → what it needs


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def notifier(clock):
    return Notifier(resolve=CLASSES.get, fallback=1.0, monotonic=clock)


def waiting(notifier, *specs) -> list[Waiter]:
    waiters = []
    for worker_id, shape in specs:
        waiter = Waiter(worker_id, shape)
        notifier.add(waiter)
        waiters.append(waiter)
    return waiters


def fired(waiters) -> list[str]:
    return [w.worker_id for w in waiters if w.wait(0)]


def test_a_wake_goes_to_the_oldest_waiters_only(notifier):
    waiters = waiting(notifier, ("w1", ANY), ("w2", ANY), ("w3", ANY))
    notifier.publish(Wake(requirements=1, count=2))
    assert fired(waiters) == ["w1", "w2"]
    assert notifier.waiting() == 1


def test_a_wake_skips_waiters_that_cannot_take_the_class(notifier):
    waiters = waiting(notifier, ("plain", ANY), ("other-pool", ("b", frozenset(), frozenset())), ("gpu", GPU))
    notifier.publish(Wake(requirements=2))  # needs the gpu capability
    assert fired(waiters) == ["gpu"]
    notifier.publish(Wake(requirements=3))  # needs pool a: nobody waiting can take it
    assert fired(waiters) == ["gpu"] and notifier.waiting() == 2


def test_a_wake_for_one_worker_wakes_only_that_worker(notifier):
    waiters = waiting(notifier, ("w1", ANY), ("w2", ANY))
    notifier.publish(Wake(requirements=1, worker_id="w2"))
    assert fired(waiters) == ["w2"]


def test_a_class_this_process_has_not_seen_wakes_someone(notifier):
    waiters = waiting(notifier, ("w1", POOL_A), ("w2", ANY))
    notifier.publish(Wake(requirements=99))
    assert fired(waiters) == ["w1"]  # let a claim find out; the cache learns the class


def test_a_rewaiting_waiter_keeps_its_place(notifier):
    first, second = waiting(notifier, ("w1", ANY), ("w2", ANY))
    notifier.publish(Wake(requirements=1))
    assert fired([first, second]) == ["w1"]
    first.take()  # its claim found nothing (another process took the job): it waits again
    notifier.add(first)
    notifier.publish(Wake(requirements=1))
    assert first.wait(0) and not second.wait(0)


def test_a_delayed_wake_fires_when_due(clock):
    notifier = Notifier(resolve=CLASSES.get, fallback=60.0, monotonic=clock)  # no fallback tick meanwhile
    (waiter,) = waiting(notifier, ("w1", ANY))
    notifier.publish(Wake(requirements=1, delay=5))
    clock.now += 4.9
    notifier.tick()
    assert not waiter.wait(0)
    clock.now += 0.2
    notifier.tick()
    assert waiter.wait(0)


def test_a_wake_carries_what_its_class_needs(notifier):
    waiters = waiting(notifier, ("plain", ANY), ("gpu", GPU))
    notifier.publish(Wake(requirements=99, needs=GPU))  # a class this process has not seen, described
    assert fired(waiters) == ["gpu"]


def test_a_blocked_waiter_hears_only_wakes_addressed_to_it(notifier, clock):
    """A worker that is draining or at capacity must not take the wakes an
    idle worker of its shape could use, nor the fallback's turns."""
    full, idle = waiting(notifier, ("full", ANY), ("idle", ANY))
    notifier.remove(full)
    full.blocked = True
    notifier.add(full)
    notifier.publish(Wake(requirements=1))
    assert fired([full, idle]) == ["idle"]
    clock.now += 1.0
    notifier.tick()
    assert not full.wait(0)  # the fallback passes it by
    notifier.publish(Wake(requirements=None, worker_id="full"))  # its undrain
    assert full.wait(0)


def test_a_waiter_leaving_gives_back_the_wake_it_did_not_use(notifier):
    first, second = waiting(notifier, ("w1", ANY), ("w2", ANY))
    notifier.publish(Wake(requirements=1))
    assert fired([first, second]) == ["w1"]  # …just as w1's wait ran out
    notifier.give_back(first)
    assert second.wait(0)


def test_the_fallback_turns_within_a_shape_too(notifier, clock):
    waiters = waiting(notifier, ("w1", ANY), ("w2", ANY))
    order = []
    for _ in range(4):
        clock.now += 1.0
        notifier.tick()
        woken = next(w for w in waiters if w.wait(0))
        order.append(woken.worker_id)
        woken.take()
        notifier.add(woken)  # it found nothing and waits again
    assert order == ["w1", "w2", "w1", "w2"]


def test_the_fallback_wakes_one_waiter_per_shape_in_turn(notifier, clock):
    waiters = waiting(notifier, ("w1", ANY), ("w2", ANY), ("g1", GPU))
    notifier.tick()
    assert fired(waiters) == []  # not yet a second
    clock.now += 1.0
    notifier.tick()
    assert fired(waiters) == ["w1"]  # the oldest waiter of the first shape
    clock.now += 1.0
    notifier.tick()
    assert fired(waiters) == ["w1", "g1"]  # then the other shape's
    assert waiters[0].by_fallback


def test_a_fallback_waiter_that_claimed_passes_the_turn(notifier):
    waiters = waiting(notifier, ("w1", ANY), ("w2", ANY))
    notifier.pass_turn()
    assert fired(waiters) == ["w1"] and waiters[0].by_fallback


def test_a_wake_between_a_claim_and_the_wait_is_not_lost(notifier):
    mark = notifier.mark()  # the long-poll's claim starts here and finds nothing…
    notifier.publish(Wake(requirements=1))  # …a job is committed meanwhile, nobody waits yet
    (waiter,) = waiting(notifier, ("w1", ANY))
    assert not waiter.wait(0)  # without the mark it would wait for the fallback
    late = Waiter("w2", ANY)
    notifier.add(late, since=mark)
    assert late.wait(0) and notifier.waiting() == 1


def test_a_missed_wake_it_cannot_use_does_not_fire_it(notifier):
    mark = notifier.mark()
    notifier.publish(Wake(requirements=2))  # gpu only
    waiter = Waiter("w1", ANY)
    notifier.add(waiter, since=mark)
    assert not waiter.wait(0) and notifier.waiting() == 1


def test_quiet_until_a_usable_wake(notifier):
    notifier.came_back_empty("w1", "s1", ANY)
    assert notifier.quiet("w1", "s1") == ANY
    notifier.publish(Wake(requirements=2))  # gpu: w1 could not use it
    assert notifier.quiet("w1", "s1") == ANY
    notifier.publish(Wake(requirements=1))
    assert notifier.quiet("w1", "s1") is None  # and the memo is gone for good
    assert notifier.quiet("w1", "s1") is None


def test_quiet_needs_the_same_session_and_a_fresh_memo(notifier, clock):
    notifier.came_back_empty("w1", "s1", ANY)
    assert notifier.quiet("w1", "s2") is None  # registered again: claim
    notifier.came_back_empty("w1", "s1", ANY)
    clock.now += Notifier.QUIET_FOR + 1
    assert notifier.quiet("w1", "s1") is None
    assert notifier.quiet("w2", "s1") is None  # never came back empty here


def test_quiet_is_not_trusted_once_the_wakes_since_were_forgotten(notifier):
    notifier.came_back_empty("w1", "s1", ANY)
    for _ in range(Notifier.RECENT + 1):
        notifier.publish(Wake(requirements=2))  # none usable by w1, but too many to remember
    assert notifier.quiet("w1", "s1") is None


def test_a_waiter_removed_is_not_woken(notifier):
    first, second = waiting(notifier, ("w1", ANY), ("w2", ANY))
    notifier.remove(first)
    notifier.publish(Wake(requirements=1))
    assert fired([first, second]) == ["w2"]


def test_next_tick_says_how_long_the_watcher_may_sleep_before_a_timer_or_the_fallback_is_due(notifier, clock):
    assert notifier.next_tick() == 1.0  # the fallback
    notifier.publish(Wake(requirements=None, delay=0.25))
    assert notifier.next_tick() == 0.25
    clock.now += 0.5
    assert notifier.next_tick() == 0.0
    notifier.tick()  # the timer fired
    assert notifier.next_tick() == 0.5
