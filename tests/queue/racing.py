"""Helpers to stage a race between two transactions on PostgreSQL: stop one
thread inside a service, start the other, let the first go."""

import threading

from django.db import connection, connections

WAIT = 20.0  # the deadline for a staged thread to get where the test wants it (tests.waiting.wait_for)


def run_thread(fn, name: str):
    """Run `fn` in a named thread with its own connection; returns (thread, out)."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as exc:  # reported to the test, which asserts on it
            out["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread, out


def lock_waiters() -> int:
    """Sessions of this database waiting for a lock."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        return cursor.fetchone()[0]


def pause_in(monkeypatch, module, name: str, thread_name: str, *, after: bool = False):
    """Make `module.name` stop, in the thread called `thread_name` only, before
    (or after) doing its work, until the returned `release` event is set."""
    original = getattr(module, name)
    paused, release = threading.Event(), threading.Event()

    def wrapper(*args, **kwargs):
        mine = threading.current_thread().name == thread_name
        if mine and not after:
            paused.set()
            release.wait(30)
        result = original(*args, **kwargs)
        if mine and after:
            paused.set()
            release.wait(30)
        return result

    monkeypatch.setattr(module, name, wrapper)
    return paused, release
