"""`apiary status [--json | --watch [--interval S]]`: job counts, workers, running and blocked jobs.

The local variant reads `jobqueue.selectors.status_document()`; the remote
variant (`--control-plane URL --token T`, the token also from
$APIARY_WORKER_TOKEN) fetches the same document from the worker protocol's
`GET status` and prints it with the same `render_status`.
"""

import argparse
import datetime as dt
import json
import os
import time

from django.core.management.base import CommandError

from apiary_site import tokens
from apiary_site.management import firstrun
from apiary_site.management.base import ApiaryCommand
from apiary_site.management.inputs import queue_database
from jobqueue.exceptions import QueueError
from jobqueue.models import JobState
from jobqueue.selectors import BLOCKED_LIMIT, status_document

STATES = tuple(JobState)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]
    return [
        "  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [headers, *rows]
    ]


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _able(worker: dict) -> bool:
    return worker["health"] == "healthy" and worker["ready"] and not worker["draining"]


def render_status(doc: dict) -> str:
    """The readable status table of a `GET status` document (local or remote)."""
    jobs = doc["jobs"]
    lines = ["Jobs: " + "  ".join(f"{state} {jobs.get(state, 0)}" for state in STATES), ""]

    lines.append("Workers")
    if doc["workers"]:
        lines += _table(
            ["ID", "POOL", "HEALTH", "CAPACITY", "ACTIVE", "DRAINING", "READY", "LAST HEARTBEAT"],
            [
                [
                    w["worker_id"],
                    w["pool"] or "-",
                    w["health"],
                    str(w["capacity"]),
                    str(w["active_jobs"]),
                    _yes(w["draining"]),
                    _yes(w["ready"]),
                    w["last_heartbeat_at"] or "-",
                ]
                for w in doc["workers"]
            ],
        )
    else:
        lines.append("  (no worker registered)")
    lines.append("")

    lines.append("Running")
    if doc["active"]:
        lines += _table(
            ["JOB", "INSTANCE", "TASK", "WORKFLOW", "PARENT", "WORKER", "ATTEMPT", "LEASE EXPIRES", ""],
            [
                [
                    str(a["job_id"]),
                    # From the job's payload: "-" for a job that names no instance, task or workflow,
                    # PARENT the instance whose spawn step created the task ("-" for none).
                    _or_dash(a["instance_id"]),
                    _or_dash(a["task_id"]),
                    _or_dash(a["workflow"]) + (f" (hook {a['hook']})" if a.get("hook") else ""),
                    _or_dash(a.get("parent_instance_id")),  # .get: a control plane older than issue 10
                    a["worker_id"],
                    str(a["attempt_number"]),
                    a["lease_expires_at"],
                    "cancel requested" if a["cancel_requested"] else "",
                ]
                for a in doc["active"]
            ],
        )
    else:
        lines.append("  (none)")
    lines.append("")

    lines.append("Blocked")
    if doc["blocked"]:
        lines += _table(["JOB", "REASON"], [[str(b["job_id"]), b["reason"]] for b in doc["blocked"]])
        if len(doc["blocked"]) >= BLOCKED_LIMIT:
            lines.append(f"  (only the first {BLOCKED_LIMIT} blocked jobs are listed)")
    else:
        lines.append("  (none)")

    queued = jobs.get("queued", 0)
    if queued and not any(_able(w) for w in doc["workers"]):
        lines += ["", f"WARNING: {queued} queued job(s) and no healthy, ready, non-draining worker to take them"]
    elif queued and len(doc["blocked"]) >= queued:
        lines += ["", f"WARNING: none of the {queued} queued job(s) can be taken by any worker now"]
    return "\n".join(lines) + "\n"


def _remote_status(*, url: str | None, token: str | None, ca_cert: str | None) -> dict:
    """`GET status` of a control plane over the worker protocol."""
    from workers.http import HttpTransport  # requests is only needed for the remote variant
    from workers.transport import TransportError, Unauthorized

    token = token or os.environ.get("APIARY_WORKER_TOKEN", "")
    if not url:
        raise CommandError("--token is for a remote status: add --control-plane URL", returncode=2)
    if not token:
        raise CommandError(
            "no worker token for --control-plane: pass --token-file PATH, or pass --token or set APIARY_WORKER_TOKEN",
            returncode=2,
        )
    transport = HttpTransport(base_url=url, token=token, worker_id="status", ca_cert=ca_cert, attempts=2)
    try:
        return transport.status()
    except Unauthorized as exc:  # the message never holds the token
        raise CommandError(f"the control plane at {url} refused the worker token: {exc.message}", returncode=2) from exc
    except TransportError as exc:
        # "cannot reach URL: connection refused" names the URL already; a 502/503/504 does not.
        message = exc.message if exc.message.startswith("cannot reach") else f"the control plane at {url}: {exc.message}"
        raise CommandError(message) from exc
    except QueueError as exc:
        raise CommandError(f"the control plane at {url} answered {exc.code}: {exc.message}") from exc


def _interval(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0.1 <= seconds <= 3600:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"expected seconds from 0.1 to 3600, got {text!r}")
    return seconds


class Command(ApiaryCommand):
    words = "status"
    help = "Show job counts, workers, running jobs and blocked jobs with the reason."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="print the GET status document of PROTOCOL.md")
        parser.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
        parser.add_argument(
            "--interval", type=_interval, default=2.0, metavar="S", help="seconds between redraws with --watch (default 2)"
        )
        parser.add_argument(
            "--config", metavar="PATH", help="apiary.yaml (default: $APIARY_CONFIG, then ./apiary.yaml)"
        )
        parser.add_argument("--control-plane", metavar="URL", help="read the status of a remote control plane")
        tokens.add_arguments(parser)  # for --control-plane; default $APIARY_WORKER_TOKEN
        parser.add_argument("--ca-cert", metavar="PATH", help="CA bundle to verify an https:// control plane")

    def handle(self, *args, **options):
        if options["watch"] and options["json"]:
            raise CommandError("--watch redraws the table; for JSON, run --json in a loop of your own", returncode=2)
        if options["control_plane"] or options["token"] or options["token_file"]:
            token = tokens.worker_token(token=options["token"], token_file=options["token_file"], warn=self.stderr.write)

            def read() -> dict:
                return _remote_status(url=options["control_plane"], token=token, ca_cert=options["ca_cert"])
        else:
            # Local: the database only. Health and limit reasons depend on the config's
            # worker_timeout and limits, so apiary.yaml is put in force when there is one, but
            # none of its ${VAR}s need be set: the listener's token is the listener's business.
            # A project where `apiary run` never ran gets its (empty) database, the true answer;
            # with no config anywhere, nothing is created (firstrun.ensure_database).
            firstrun.ensure_database(options["config"])

            def read() -> dict:
                with queue_database():
                    return status_document()

        if not options["watch"]:
            doc = read()
            if options["json"]:
                self.stdout.write(json.dumps(doc, indent=2))
            else:
                self.stdout.write(render_status(doc), ending="")
            return
        try:
            self._watch(read, options["interval"])
        except KeyboardInterrupt:  # Ctrl-C is how a watch ends: a clean exit, no traceback
            self.stdout.write("")

    def _watch(self, read, interval: float) -> None:
        """Clear the screen and redraw every `interval` seconds. A read that
        fails (the control plane restarting, a busy database) is shown in
        place of the table, and the next round tries again."""
        clear = "\x1b[H\x1b[2J" if self.stdout.isatty() else ""
        while True:
            try:
                body = render_status(read())
            except CommandError as exc:
                body = f"{exc}\n"
            stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
            self.stdout.write(f"{clear}apiary status, every {interval:g}s (Ctrl-C to stop), {stamp}\n\n{body}", ending="")
            self.stdout.flush()
            time.sleep(interval)
