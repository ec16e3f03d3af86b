"""`apiary worker`: a remote worker claiming jobs from a control plane over HTTP."""

import logging
import threading

from django.core.management.base import CommandError

from apiary_site import tokens
from apiary_site.management.base import ApiaryCommand
from jobqueue.exceptions import Forbidden
from jobqueue.types import EMBEDDED_ID, MAX_CAPACITY, WORKER_ID_HINT, WORKER_ID_RE
from workers import private
from workers.backoff import Backoff
from workers.credentials import CredentialElsewhere, CredentialFile
from workers.http import HttpTransport
from workers.localdb import LocalDB
from workers.pgroups import ProcessGroups
from workers.runtime import WorkerRuntime
from workers.signals import Signals
from workers.transport import TransportError, Unauthorized, WorkerSpec
from workflows import runners
from workflows.config import ConfigError, find_config_path, load
from workflows.executor import Executor
from workflows.services import worker_capabilities

log = logging.getLogger("apiary.worker")


class Command(ApiaryCommand):
    words = "worker"
    help = "Run a remote worker: claim jobs from a control plane over the worker protocol and run them."

    def add_arguments(self, parser):
        parser.add_argument("--control-plane", required=True, metavar="URL", help="base URL, e.g. http://10.0.0.5:8080")
        tokens.add_arguments(parser)  # --token, --token-file; default $APIARY_WORKER_TOKEN
        parser.add_argument(
            "--id",
            dest="worker_id",
            required=True,
            metavar="ID",
            help="worker id, unique per process; its credential is kept in .apiary/workers/ID.credential",
        )
        parser.add_argument(
            "--pool", default=None, metavar="P",
            help="this worker's pool: jobs of agents with worker_pool P run only on workers of pool P "
            "(jobs with no pool run on any worker)",
        )
        parser.add_argument(
            "--label", action="append", default=[], metavar="L",
            help="a label this worker has (repeatable): agents' requires_labels must all be among them",
        )
        parser.add_argument(
            "--capability", action="append", default=[], metavar="C",
            help="a capability this worker offers (repeatable), besides the runners it finds on PATH: "
            "agents' requires_capabilities must all be among them",
        )
        parser.add_argument(
            "--capacity", type=int, default=1, metavar="N", help=f"jobs run at once, 1–{MAX_CAPACITY} (default 1)"
        )
        parser.add_argument(
            "--config", metavar="PATH", help="apiary.yaml with the agents and workflows (default: $APIARY_CONFIG, then ./apiary.yaml)"
        )
        parser.add_argument("--ca-cert", metavar="PATH", help="CA bundle to verify an https:// control plane")
        parser.add_argument(
            "--claim-wait", type=float, default=10.0, metavar="S", help="long-poll seconds per claim, 0–30 (default 10)"
        )
        parser.add_argument(
            "--grace", type=float, default=5.0, metavar="S", help="seconds between SIGTERM and SIGKILL of a step (default 5)"
        )

    def handle(self, *args, **options):
        token = tokens.worker_token(token=options["token"], token_file=options["token_file"], warn=self.stderr.write)
        if not token:
            raise CommandError(
                "no worker token: pass --token-file PATH, or pass --token or set APIARY_WORKER_TOKEN", returncode=2
            )
        if not 1 <= options["capacity"] <= MAX_CAPACITY:
            raise CommandError(f"--capacity must be 1–{MAX_CAPACITY}, got {options['capacity']}", returncode=2)
        try:
            # The worker ignores the queue settings: the listener's ${APIARY_WORKER_TOKEN} need not be
            # set where the token comes from --token-file. Agents' and steps' variables must be.
            config = load(find_config_path(options["config"]), unset_ok=("settings.queue",))
        except ConfigError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        worker_id = options["worker_id"]
        if not WORKER_ID_RE.fullmatch(worker_id):  # also a file name under .apiary/: checked before any use
            raise CommandError(f"--id {worker_id!r}: expected {WORKER_ID_HINT}", returncode=2)
        if worker_id == EMBEDDED_ID:
            raise CommandError(f"--id {EMBEDDED_ID!r} is reserved for the control plane's embedded worker", returncode=2)
        state = private.private_dir(config.state_dir)  # 0700: histories and logs are the owner's only
        groups = ProcessGroups(state / "run" / worker_id)
        groups.reap_orphans(grace=options["grace"])
        localdb = LocalDB(state / "workers" / f"{worker_id}.db")
        spec = WorkerSpec(
            worker_id=worker_id,
            pool=options["pool"],
            labels=tuple(sorted(set(options["label"]))),
            capabilities=worker_capabilities(runners.available_adapters(), tuple(options["capability"])),
            capacity=options["capacity"],
        )
        try:
            transport = HttpTransport(
                base_url=options["control_plane"],
                token=token,
                worker_id=worker_id,
                ca_cert=options["ca_cert"],
                capacity=spec.capacity,  # the pool its job threads' finishes share
                credential_file=CredentialFile(state / "workers" / f"{worker_id}.credential"),
            )
        except CredentialElsewhere as exc:
            raise CommandError(str(exc), returncode=2) from exc
        runtime = WorkerRuntime(
            transport=transport,
            spec=spec,
            executor=Executor(config=config, worker_id=worker_id, history=localdb, groups=groups),
            claim_wait=max(0.0, min(30.0, options["claim_wait"])),
            grace=options["grace"],
            outbox=localdb,
        )
        signals = Signals()
        signals.install()
        try:
            self._start(runtime, signals)
            # The claim loop runs in a thread so this thread stays free for signals.
            result = {}
            loop = threading.Thread(target=lambda: result.setdefault("code", runtime.run()), name="claim-loop")
            loop.start()
            while loop.is_alive():
                loop.join(0.2)
                signals.act(runtime)
        except Unauthorized as exc:
            raise CommandError(f"the control plane refused the worker token: {exc}", returncode=2) from exc
        except Forbidden as exc:
            raise CommandError(f"the control plane refused worker {worker_id!r}: {exc}", returncode=2) from exc
        finally:
            signals.restore()
            localdb.close()
        if result.get("code", 1):
            raise SystemExit(result.get("code", 1))

    def _start(self, runtime: WorkerRuntime, signals: Signals, backoff: Backoff | None = None) -> None:
        """Register, waiting out a control plane that is not up yet (a signal meanwhile exits 0).
        The only retry layer of registration: the transport sends each try once."""
        backoff = backoff or Backoff(base=0.5, cap=10.0)
        while True:
            try:
                runtime.start()
                return
            except TransportError as exc:
                delay = backoff.failed(exc.retry_after)
                log.warning("worker %s: registration failed (%s); retrying in %.2fs", runtime.spec.worker_id, exc, delay)
                if signals.received.wait(delay):
                    raise SystemExit(0) from exc
