"""Child process of tests/test_dispatch_batches.py: one poll of the source `inbox`,
optionally killed (SIGKILL) inside batch K, after its jobs are written and before
it commits. Prints the number of jobs created when it lives.

    python -m tests.poll_child CONFIG --batch N [--kill-in-batch K] [--migrate]

The database comes from the environment as for any Apiary process (APIARY_DB_PATH
or DATABASE_URL).
"""

import argparse
import os
import signal

from tests.child import django_child


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--kill-in-batch", type=int, default=0)
    args = django_child(parser)
    from workflows import services
    from workflows.config import load
    from workflows.controlplane import ControlPlane

    services.BATCH = args.batch
    if args.kill_in_batch:
        enqueue, batches = services.queue.jobs_enqueue_in, []

        def enqueue_then_die(specs, **kwargs):
            result = enqueue(specs, **kwargs)
            batches.append(len(specs))
            if len(batches) == args.kill_in_batch:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        services.queue.jobs_enqueue_in = enqueue_then_die
    print(ControlPlane(config=load(args.config, environ={})).poll("inbox"), flush=True)


if __name__ == "__main__":
    main()
