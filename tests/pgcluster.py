"""A throwaway PostgreSQL cluster in a temporary directory, for tests and benchmarks.

Plain module (no pytest), so bench/ can use it too:

    cluster = start_cluster()
    url = cluster.create_database("apiary_bench")   # postgres://postgres@127.0.0.1:PORT/apiary_bench
    ...
    cluster.stop()

The cluster listens on a free TCP port on 127.0.0.1 (plus a unix socket in its
own directory, never the system's), trusts local connections, keeps fsync on
so commit costs are realistic, and allows enough connections for
multi-process tests. `initdb` and `pg_ctl` refuse to run as root: as root the
cluster runs as the `postgres` OS user that Debian's package creates.
"""

import atexit
import contextlib
import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

SERVER_PROGRAMS = ("initdb", "pg_ctl", "postgres")
SUPERUSER = "postgres"
RUN_AS = "postgres"  # the OS user a root process runs the server as


def _is_bindir(path: Path) -> bool:
    return all(os.access(path / name, os.X_OK) for name in SERVER_PROGRAMS)


def _version_key(path: Path) -> tuple:
    """/usr/lib/postgresql/15/bin → (15,), so the newest installed major wins."""
    return tuple(int(p) for p in path.parent.name.split(".") if p.isdigit())


def find_bindir() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres, or None when the
    server is not installed. $APIARY_PG_BINDIR, when set, is the only place
    looked at; otherwise `pg_config --bindir`, /usr/lib/postgresql/*/bin
    (Debian keeps them off PATH, newest first), then PATH."""
    if os.environ.get("APIARY_PG_BINDIR"):  # explicit: only that one
        chosen = Path(os.environ["APIARY_PG_BINDIR"])
        return chosen if _is_bindir(chosen) else None
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True)
            candidates.append(Path(out.stdout.strip()))
    candidates += sorted((Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin")), key=_version_key, reverse=True)
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(initdb).resolve().parent)
    return next((c for c in candidates if _is_bindir(c)), None)


def server_version(bindir: Path) -> str:
    """ "15.18" for the server in `bindir` ("unknown" if it will not say)."""
    try:
        out = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    found = re.search(r"\d+(\.\d+)*", out.stdout)  # "postgres (PostgreSQL) 15.18 (Debian …)"
    return found.group(0) if out.returncode == 0 and found else "unknown"


def _free_port() -> int:
    # The port is free now; another process may take it before the server
    # binds it, so start_cluster retries with a new one.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A running throwaway cluster. `stop()` kills it and deletes its directory."""

    host = "127.0.0.1"

    def __init__(self, *, bindir: Path, directory: Path, port: int, run_as: str | None):
        self.bindir = bindir
        self.directory = directory
        self.data = directory / "data"
        self.port = port
        self.run_as = run_as
        self._stopped = False

    def url(self, dbname: str = "postgres") -> str:
        return f"postgres://{SUPERUSER}@{self.host}:{self.port}/{dbname}"

    def _run(self, program: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        command = [str(self.bindir / program), *args]
        if self.run_as:
            command = ["runuser", "-u", self.run_as, "--", *command]
        # cwd: the server user may not be allowed into the caller's directory.
        result = subprocess.run(
            command, cwd=self.directory, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{program} {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}{self._log_tail()}"
            )
        return result

    def _log_tail(self) -> str:
        log = self.directory / "server.log"
        if not log.exists():
            return ""
        return "\n--- server.log (tail) ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:])

    def create_database(self, name: str) -> str:
        """CREATE DATABASE `name`; returns its URL."""
        self._run("createdb", "-h", self.host, "-p", str(self.port), "-U", SUPERUSER, name)
        return self.url(name)

    def stop(self) -> None:
        """Kill the server at once (the data is throwaway) and delete the directory. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w", timeout=60)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __repr__(self) -> str:
        return f"<Cluster {self.url()} in {self.directory}>"


def _server_user() -> str | None:
    """None: run as ourselves. As root: the `postgres` user (initdb refuses root)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(RUN_AS)
    except KeyError:
        raise RuntimeError(
            f"running as root and there is no {RUN_AS!r} OS user to run PostgreSQL as "
            "(initdb refuses root); install the postgresql package or run as an unprivileged user"
        ) from None
    if not shutil.which("runuser"):
        raise RuntimeError("running as root but `runuser` is not installed; cannot drop to the postgres user")
    return RUN_AS


def _configure(data: Path, *, port: int, socket_dir: Path) -> None:
    settings = {
        "port": str(port),
        "listen_addresses": "'127.0.0.1'",
        "unix_socket_directories": f"'{socket_dir}'",
        "max_connections": "200",
        # Durability as in production: commit costs are part of what the tests and benchmarks measure.
        "fsync": "on",
        "synchronous_commit": "on",
        "full_page_writes": "on",
        "shared_buffers": "128MB",
        "max_locks_per_transaction": "128",
        "log_min_messages": "warning",
        "timezone": "'UTC'",
    }
    with open(data / "postgresql.conf", "a") as conf:
        conf.write("\n# apiary throwaway cluster (tests/pgcluster.py)\n")
        conf.writelines(f"{key} = {value}\n" for key, value in settings.items())


def start_cluster(base_dir: Path | None = None) -> Cluster:
    """initdb + pg_ctl start in a new temporary directory (under `base_dir` if
    given, which the server user must be able to enter). Raises RuntimeError
    when the server binaries are missing or the server does not start."""
    bindir = find_bindir()
    if bindir is None:
        raise RuntimeError("PostgreSQL server binaries not found (pg_config --bindir, /usr/lib/postgresql/*/bin, PATH)")
    run_as = _server_user()
    directory = Path(tempfile.mkdtemp(prefix="apiary-pg-", dir=base_dir))
    if run_as:
        entry = pwd.getpwnam(run_as)
        os.chown(directory, entry.pw_uid, entry.pw_gid)
    cluster = Cluster(bindir=bindir, directory=directory, port=0, run_as=run_as)
    try:
        # --no-sync only skips flushing initdb's own files: a crash here just means a new cluster.
        cluster._run(
            "initdb", "-D", str(cluster.data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync"
        )
        for _ in range(5):
            cluster.port = _free_port()
            _configure(cluster.data, port=cluster.port, socket_dir=directory)
            try:
                cluster._run(
                    "pg_ctl", "start", "-D", str(cluster.data), "-l", str(directory / "server.log"), "-w", "-t", "60"
                )
                break
            except RuntimeError:
                if "could not bind" not in cluster._log_tail() and "in use" not in cluster._log_tail():
                    raise
        else:
            raise RuntimeError(f"PostgreSQL could not bind a free port:{cluster._log_tail()}")
    except BaseException:
        cluster.stop()
        raise
    atexit.register(cluster.stop)  # a crashed caller must not leave a server behind
    return cluster
