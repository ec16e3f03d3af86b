"""`apiary logs INSTANCE [--step S] [-f]`: a workflow instance's step logs.

By default every step of the instance's latest attempt, in the order the
steps began (then its hook jobs' steps); `--step` one of them; `-f` follows
the log as the step writes it, until the step ends (without `--step`: every
step of the attempt, and of the next attempt when the job is retried, until
the instance's job ends). Locally it reads the database (workflows/logs.py);
with `--control-plane URL --token-file F` it reads the same documents from
the worker protocol's `GET instances/{id}/logs…`, as `apiary status` does.
The logs are what the workers streamed to the control plane: the last MiB
of each step (a marker says when earlier text was dropped).
"""

import time

from django.core.management.base import CommandError

from apiary_site import tokens
from apiary_site.management import firstrun
from apiary_site.management.base import ApiaryCommand
from apiary_site.management.inputs import positive_id, queue_database
from jobqueue.exceptions import NotFound, QueueError
from jobqueue.models import TERMINAL_JOB_STATES
from workflows import logs

POLL = 0.5  # seconds between looks at a followed log


class LocalLogs:
    def listing(self, instance_id: int) -> dict:
        return logs.instance_logs(instance_id=instance_id)

    def page(self, instance_id: int, attempt_number: int, step: str, offset: int) -> dict:
        return logs.instance_log_text(instance_id=instance_id, attempt_number=attempt_number, step=step, offset=offset)


class RemoteLogs:
    def __init__(self, *, url: str, token: str, ca_cert: str | None):
        from workers.http import HttpTransport  # requests is only needed for the remote variant

        self.url = url
        self.transport = HttpTransport(base_url=url, token=token, worker_id="logs", ca_cert=ca_cert, attempts=2)

    def listing(self, instance_id: int) -> dict:
        return self.transport.instance_logs(instance_id)

    def page(self, instance_id: int, attempt_number: int, step: str, offset: int) -> dict:
        return self.transport.instance_log_text(instance_id, attempt_number, step, offset)


def _latest(listing: dict) -> list[dict]:
    """The steps of each job's latest attempt (the instance's own job, then its hook jobs), in order."""
    newest: dict[int, int] = {}
    for step in listing["steps"]:
        newest[step["job_id"]] = max(newest.get(step["job_id"], 0), step["attempt_number"])
    return [step for step in listing["steps"] if step["attempt_number"] == newest[step["job_id"]]]


class Command(ApiaryCommand):
    words = "logs"
    help = "Print a workflow instance's step logs (its latest attempt); -f follows them while the steps run."

    def add_arguments(self, parser):
        parser.add_argument("instance", type=positive_id, help="workflow instance id")
        parser.add_argument("--step", metavar="STEP", help="only this step (its id; hook steps: hook:<outcome>:<step>)")
        parser.add_argument("-f", "--follow", action="store_true", help="follow the log until the step (or the instance) ends")
        parser.add_argument("--config", metavar="PATH", help="apiary.yaml (read by the apiary entry point)")
        parser.add_argument("--control-plane", metavar="URL", help="read the logs from a remote control plane")
        tokens.add_arguments(parser)
        parser.add_argument("--ca-cert", metavar="PATH", help="CA bundle to verify an https:// control plane")

    def handle(self, *args, **options):
        remote = options["control_plane"] or options["token"] or options["token_file"]
        if remote:
            if not options["control_plane"]:
                raise CommandError("--token-file is for remote logs: add --control-plane URL", returncode=2)
            token = tokens.worker_token(token=options["token"], token_file=options["token_file"], warn=self.stderr.write)
            if not token:
                raise CommandError("no worker token for --control-plane: pass --token-file PATH", returncode=2)
            self.source = RemoteLogs(url=options["control_plane"], token=token, ca_cert=options["ca_cert"])
        else:
            # No database yet: one line (firstrun.require_database). Logs exist only once `apiary run` ran.
            firstrun.require_database()
            self.source = LocalLogs()
        self.instance_id = options["instance"]
        try:
            if remote:
                self._print(options["step"], options["follow"])
            else:
                with queue_database():
                    self._print(options["step"], options["follow"])
        except NotFound as exc:
            raise CommandError(exc.message) from None
        except QueueError as exc:  # a remote control plane that refused or could not answer
            where = f"the control plane at {options['control_plane']}"
            if exc.code != "transport_error":
                raise CommandError(f"{where} answered {exc.code}: {exc.message}") from None
            # The transport's message names the URL already ("cannot reach URL: connection refused").
            raise CommandError(exc.message if exc.message.startswith("cannot reach") else f"cannot reach {where}: {exc.message}") from None
        except KeyboardInterrupt:
            pass

    def _print(self, only: str | None, follow: bool) -> None:
        printed: set[tuple[int, int, str]] = set()
        while True:
            listing = self.source.listing(self.instance_id)
            steps = [s for s in _latest(listing) if only is None or s["step"] == only]
            if only is not None and not steps and not follow:
                names = ", ".join(dict.fromkeys(s["step"] for s in _latest(listing))) or "none yet"
                raise CommandError(f"instance {self.instance_id} has no log of step {only!r} (its steps: {names})")
            for step in steps:
                key = (step["job_id"], step["attempt_number"], step["step"])
                if key in printed:
                    continue
                if only is None:
                    self._write(f"==> {step['step']} (attempt {step['attempt_number']}, worker {step['worker_id']}) <==\n")
                self._stream(step, follow)
                printed.add(key)
                if only is not None:
                    return
            ended = listing["state"] is None or listing["state"] in TERMINAL_JOB_STATES
            if not follow or ended:
                if only is not None and not steps:
                    raise CommandError(f"instance {self.instance_id} ended without a log of step {only!r}")
                return
            time.sleep(POLL)

    def _stream(self, step: dict, follow: bool) -> None:
        """Print one step's log from its start; with `follow`, until it ends."""
        offset = 0
        while True:
            page = self.source.page(self.instance_id, step["attempt_number"], step["step"], offset)
            if offset == 0 and page["offset"] > 0:
                self._write(logs.dropped_marker(page["offset"]))
            self._write(page["text"])
            offset = page["next_offset"]
            if offset < page["received"]:
                continue  # more is there already
            if not follow or page["ended"] or page["attempt_state"] != "active":
                if not self.at_line_start:  # the next header, or the prompt, on a line of its own
                    self._write("\n")
                return
            time.sleep(POLL)

    at_line_start = True

    def _write(self, text: str) -> None:
        if text:
            self.stdout.write(text, ending="")
            self.stdout.flush()
            self.at_line_start = text.endswith("\n")
