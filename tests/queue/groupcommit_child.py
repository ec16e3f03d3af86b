"""Child process of tests/queue/test_group_commit_kill.py: finishes through a group committer.

    python -m tests.queue.groupcommit_child --jobs N --threads T --hold-batch K [--migrate]

Enqueues N jobs, claims them all for one worker, then T threads finish them
through one GroupCommitter and print `ACK <attempt id>` the moment each finish
is answered. The K-th commit that holds more than one finish prints
`HOLD <attempt ids>` after its statements ran and before its COMMIT, then
waits for ever: the parent kills the process there, between the batch and
its answers."""

import argparse
import sys
import threading

from tests.child import django_child

_out = threading.Lock()


def say(line: str) -> None:
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--hold-batch", type=int, required=True)
    args = django_child(parser)
    from django.db import connection

    from jobqueue import services
    from jobqueue.groupcommit import GroupCommitter
    from tests.factories import enqueue_job, make_task, register

    for _ in range(args.jobs):
        enqueue_job(make_task())
    worker = register(capacity=args.jobs)
    claims = services.jobs_claim(worker_id=worker.worker_id, session=worker.session, max_jobs=args.jobs)
    connection.close()
    committer = GroupCommitter()
    grouped = 0
    in_batch: list[int] = []  # attempt ids of the finishes the commit being made holds

    def before_commit(size: int) -> None:
        nonlocal grouped
        if size > 1:
            grouped += 1
            if grouped == args.hold_batch:
                say("HOLD " + " ".join(map(str, in_batch)))
                threading.Event().wait()  # killed here: the batch ran, its COMMIT never will
        in_batch.clear()

    committer.before_commit = before_commit
    finish_body = services.attempt_finish.body

    def noted_finish(**kwargs):
        in_batch.append(kwargs["attempt_id"])  # runs in the committing thread, inside the batch
        return finish_body(**kwargs)

    noted_finish.body = noted_finish
    todo = list(claims)
    todo_lock = threading.Lock()

    def run() -> None:
        while True:
            with todo_lock:
                if not todo:
                    return
                c = todo.pop()
            committer.call(noted_finish, attempt_id=c.attempt_id, token=c.token, outcome="succeeded", summary={})
            say(f"ACK {c.attempt_id}")

    say("READY")
    threads = [threading.Thread(target=run, daemon=True) for _ in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    say("DONE")


if __name__ == "__main__":
    main()
