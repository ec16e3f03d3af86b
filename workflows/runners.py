"""Runner adapters: build a step's command line and run it as a process group.

Adapters (`runner` in apiary.yaml → adapter → executable):

* `shell` → `shell` → `sh`: the agent's `command` (a string for `sh -c`, or
  an argv list) gets the prompt on stdin and in `APIARY_PROMPT`.
* `codex` → `codex-cli` → `codex`: `codex exec --skip-git-repo-check
  [--model M] -- PROMPT`. The prompt is one positional argument (as the Codex
  docs recommend); `codex exec` prints its progress on stderr and only the
  final agent message on stdout, so stdout is the step's output.
  `--skip-git-repo-check` because Apiary runs steps in its own workspace
  directory (`.apiary/workspaces/<task>/`), which is usually not a Git
  repository and which codex would otherwise refuse to work in.
* `claude` → `claude-code` → `claude`: `claude -p [--model M] -- PROMPT`.

Both agent CLIs get `--` before the prompt: task text is untrusted, and a
prompt that starts with `-` (a Markdown list, or `--dangerously-…`) must
never be parsed as an option; after `--` clap (codex) and commander (claude)
treat everything as positional, and clap also stops matching subcommands
(a prompt reading "resume" stays a prompt). Their stdin is /dev/null: both
read piped stdin as extra context, and an inherited stdin could block them.

`run_step` starts the process in a new session (its own process group, whose
id the caller records so a successor can end what a killed daemon left
behind), streams stdout and stderr into the step log as they arrive, keeps
stdout as the step's output, and stops the whole group on timeout or cancel:
SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from workers import private
from workers.pgroups import KILL_WAIT, kill_process_group, process_group_alive, signal_group

if TYPE_CHECKING:
    from workflows.config import AgentConfig

logger = logging.getLogger("apiary.runners")

# runner (what apiary.yaml says) -> adapter (what workers advertise as `runner:<adapter>`).
# The one list of runners: workflows.config checks `runner` against it, in this order.
ADAPTER_OF = {"codex": "codex-cli", "claude": "claude-code", "shell": "shell"}
EXECUTABLE = {"codex-cli": "codex", "claude-code": "claude", "shell": "sh"}

OUTPUT_CAP = 1024 * 1024  # bytes of stdout kept for `steps.<id>.output`; the log has everything
POLL_INTERVAL = 0.05  # how often a running step checks cancel/timeout (the contract is ≤ 0.1 s)


@dataclass(frozen=True)
class StepResult:
    status: str  # succeeded | failed | cancelled | timed_out
    exit_code: int | None  # None when never started or stopped by us; negative = killed by that signal
    started_at: datetime
    ended_at: datetime
    duration: float
    log_path: str
    output: str  # stdout, capped at OUTPUT_CAP bytes
    output_tail: str  # the last bytes of stdout+stderr, for status and history


def available_adapters(path: str | None = None) -> set[str]:
    """Adapters whose executable is on PATH (`path` overrides $PATH)."""
    return {adapter for adapter, exe in EXECUTABLE.items() if shutil.which(exe, path=path)}


def build_prompt_command(agent: AgentConfig, prompt: str) -> tuple[list[str], str | None, dict[str, str]]:
    """(argv, stdin text, extra environment) for a prompt step of `agent`.

    The extra environment holds only what the adapter needs; the caller
    layers it over the base, agent and step environments."""
    adapter = agent.adapter or ADAPTER_OF.get(agent.runner, "")
    if adapter == "shell":
        if not agent.command:
            raise ValueError(f"agent {agent.id!r} (runner shell) has no command to run prompts with")
        argv = ["sh", "-c", agent.command] if isinstance(agent.command, str) else [str(a) for a in agent.command]
        return argv, prompt, {"APIARY_PROMPT": prompt}
    model = ["--model", agent.model] if agent.model else []
    if adapter == "codex-cli":
        return ["codex", "exec", "--skip-git-repo-check", *model, "--", prompt], None, {}
    if adapter == "claude-code":
        return ["claude", "-p", *model, "--", prompt], None, {}
    raise ValueError(f"agent {agent.id!r}: unknown adapter {adapter!r} (expected one of {sorted(EXECUTABLE)})")


def build_run_command(run_text: str) -> list[str]:
    """argv for a `run` step; `run_text` must already be rendered (templates.render_command)."""
    return ["sh", "-c", run_text]


def run_step(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    stdin: str | None,
    log_path: Path,
    timeout: float | None,
    cancel: threading.Event,
    grace: float = 5.0,
    on_spawn: Callable[[int], None] | None = None,
    on_output: Callable[[], None] | None = None,
    tail_bytes: int = 4000,
) -> StepResult:
    """Run one step to its end and report how it ended. Never raises for the
    step's own failures (missing executable, bad cwd, non-zero exit).

    `env` is the complete environment of the process (not merged with ours).
    `on_output()` is called on this thread each time output of the step was
    written to its log (the log sender starts streaming at the first)."""
    log_path = Path(log_path)
    started_at = datetime.now(UTC)
    began = time.monotonic()
    capture = _Capture(tail_bytes=tail_bytes)

    def result(status: str, exit_code: int | None) -> StepResult:
        return StepResult(
            status=status,
            exit_code=exit_code,
            started_at=started_at,
            ended_at=datetime.now(UTC),
            duration=time.monotonic() - began,
            log_path=str(log_path),
            output=capture.output(),
            output_tail=capture.tail(),
        )

    # Append: a rerun of the step (a new attempt) must not erase what the previous one logged.
    with _open_log(log_path) as log:  # 0600: steps print secrets too
        if cancel.is_set():
            return result("cancelled", None)
        try:
            proc = _start(argv, cwd=cwd, env=env, stdin=stdin is not None)
        except OSError as exc:
            message = f"apiary: cannot start {argv[0]!r} in {cwd}: {exc}\n".encode()
            log.write(message)
            capture.add(message, stdout=False)
            return result("failed", None)

        pgid = proc.pid  # start_new_session: the child leads its own session and group
        if on_spawn is not None:
            try:
                on_spawn(pgid)
            except Exception:
                # Without the record a successor could not clean up; do not run unrecorded.
                kill_process_group(pgid, 0)
                proc.wait()
                raise
        try:
            output = _Output(proc, log, capture, on_output)
        except Exception:  # no way to watch it (out of descriptors): it must not run unwatched
            kill_process_group(pgid, 0)
            proc.wait()
            raise
        try:
            if stdin is not None:
                threading.Thread(target=_feed, args=(proc, stdin), name=f"step-stdin-{pgid}", daemon=True).start()
            stopped_because = _watch(proc, output, cancel, None if timeout is None else began + timeout)
            # Whatever is left of the group goes too — after a stop, and also after a normal exit:
            # a background child of the step would otherwise outlive it and hold the log pipes open.
            if stopped_because:
                logger.info("step pgid %s: %s, stopping its process group", pgid, stopped_because)
            _stop_group(proc, output, grace=grace)
            output.drain()
        finally:
            output.close()
        exit_code = proc.returncode
        if stopped_because:
            note = f"\napiary: step {stopped_because.replace('_', ' ')} (exit {exit_code})\n".encode()
            log.write(note)
            capture.add(note, stdout=False)
            return result(stopped_because, exit_code)
        return result("succeeded" if exit_code == 0 else "failed", exit_code)


# (command name, PATH) → the executable found there and when: a shell's command hash. Without it
# the child looks the name up itself, one execve per PATH entry before the one that holds it
# (eight on a PATH with a few tool folders ahead of /usr/bin) for every step. An entry is looked
# up again after HASH_SECONDS, so a command installed meanwhile in an earlier folder is found.
_hashed: dict[tuple[str, str], tuple[str, float]] = {}
HASH_SECONDS = 60.0


def _start(argv: list[str], *, cwd: Path, env: dict[str, str], stdin: bool) -> subprocess.Popen:
    """The step's process, in a session of its own, its output on two pipes."""
    path = env.get("PATH", os.defpath)  # where the child would look: its own environment's PATH
    options = {
        "cwd": cwd,
        "env": env,
        "stdin": subprocess.PIPE if stdin else _devnull(),
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        # No preexec_fn, and start_new_session rather than one: CPython then starts the child
        # with vfork (3.11), not a fork that copies the page tables of the whole worker.
        "start_new_session": True,
        "close_fds": True,
        "bufsize": 0,  # raw pipes: _Output reads their descriptors, so no buffers (nor isatty, lseek) to set up
    }
    executable = _looked_up(argv[0], path)
    if executable is not None:
        try:
            return subprocess.Popen(argv, executable=executable, **options)
        except OSError:
            # Gone, no longer executable, or a script whose interpreter is gone since it was found
            # (or the cwd is missing): the child's own search decides, as without the hash.
            _hashed.pop((argv[0], path), None)
    return subprocess.Popen(argv, **options)


def _looked_up(name: str, path: str) -> str | None:
    """Where the child would find `name` on `path`, from the hash or found now; None where the
    child must look itself: a name with a folder in it, or a PATH with a relative or empty entry
    (the child looks after its chdir into the workspace, where such an entry names another folder)."""
    now = time.monotonic()
    found, at = _hashed.get((name, path), (None, 0.0))
    if found is not None and now - at < HASH_SECONDS:
        return found
    if os.sep in name or not all(map(os.path.isabs, path.split(os.pathsep))):
        return None
    found = shutil.which(name, path=path)
    if found is not None:
        _hashed[(name, path)] = (found, now)
    return found


def _open_log(log_path: Path) -> _Log:
    """The step log, opened to append; its folder made (0700) only when missing: the executor
    already made it private for the job, so an existing one costs no mkdir."""
    try:
        return _Log(private.open_private_fd(log_path, append=True))
    except FileNotFoundError:
        private.private_dir(log_path.parent)
        return _Log(private.open_private_fd(log_path, append=True))


class _Log:
    """The step log written by its descriptor (O_APPEND): a file object would cost an fstat
    and a seek to set up for every step, and buffers nothing here."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes) -> None:
        private.write_all(self.fd, data)

    def __enter__(self) -> _Log:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


@functools.cache
def _devnull() -> int:
    """/dev/null, opened once for the stdin of every step that gets no prompt (Popen's DEVNULL
    opens and closes it for each). Two first steps at once may both open it: the one not cached
    then stays open, unused (one descriptor, once)."""
    return os.open(os.devnull, os.O_RDWR)  # not inherited: Python opens descriptors close-on-exec


def _watch(proc: subprocess.Popen, output: _Output, cancel: threading.Event, deadline: float | None) -> str | None:
    """Copy the step's output into its log until its leader exits; why it must be stopped
    first (cancelled, timed_out), else None. It waits in one select on the pipes and the
    leader's pidfd, so an exit or a line ends the wait at once; the timeout only bounds how
    late a cancel (an Event, which no select can watch) is seen."""
    exited = _pidfd(proc.pid)
    if exited is not None:
        output.selector.register(exited, selectors.EVENT_READ, None)
    try:
        while proc.poll() is None:
            if cancel.is_set():
                return "cancelled"
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return "timed_out"
            output.pump(POLL_INTERVAL if deadline is None else min(POLL_INTERVAL, deadline - now))
        return None
    finally:
        if exited is not None:
            output.selector.unregister(exited)
            os.close(exited)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` exits (Linux 5.3+); None where there is
    none, and the wait falls back to looking every POLL_INTERVAL."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _stop_group(proc: subprocess.Popen, output: _Output, *, grace: float) -> None:
    """End every process of the step's group and reap the leader, copying its output meanwhile."""
    pgid = proc.pid
    if _group_has_live_members(proc):
        signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _group_has_live_members(proc) and time.monotonic() < deadline:
            output.pump_for(POLL_INTERVAL)  # no process group can be waited for: look again then
        if _group_has_live_members(proc):
            signal_group(pgid, signal.SIGKILL)
            deadline = time.monotonic() + KILL_WAIT
            while _group_has_live_members(proc) and time.monotonic() < deadline:
                output.pump_for(POLL_INTERVAL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_WAIT)
    if proc.returncode is None:
        logger.error("step pgid %s: leader did not exit after SIGKILL", pgid)


def _group_has_live_members(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the leader as soon as it exits, so its zombie does not count
    return process_group_alive(proc.pid)


def printable(data: bytes) -> str:
    """Output as text that every store accepts: invalid UTF-8 and NUL (which
    PostgreSQL text and JSON refuse) become U+FFFD."""
    return data.decode("utf-8", errors="replace").replace("\x00", "\ufffd")


class _Capture:
    """Keeps stdout (capped) for the step output and a tail of everything."""

    def __init__(self, *, tail_bytes: int) -> None:
        self._stdout = bytearray()
        self._tail = bytearray()
        self._tail_bytes = tail_bytes

    def add(self, chunk: bytes, *, stdout: bool) -> None:
        if stdout and len(self._stdout) < OUTPUT_CAP:
            self._stdout += chunk[: OUTPUT_CAP - len(self._stdout)]
        self._tail += chunk
        if len(self._tail) > self._tail_bytes:
            del self._tail[: len(self._tail) - self._tail_bytes]

    def output(self) -> str:
        return printable(self._stdout)

    def tail(self) -> str:
        return printable(self._tail)


DRAIN_QUIET = 0.1  # seconds without output after which a group that is gone has said all it will


class _Output:
    """The step's stdout and stderr, copied into the log (and the capture) by the thread that
    runs the step: one select over both pipes (and whatever else `_watch` registers)."""

    def __init__(self, proc: subprocess.Popen, log, capture: _Capture, on_output: Callable[[], None] | None = None) -> None:
        self.proc, self.log, self.capture, self.on_output = proc, log, capture, on_output
        # poll(2), not epoll: a step's three descriptors cost no epoll instance to create, fill and
        # close for every step, and one poll over three is as cheap as an epoll_wait.
        self.selector = selectors.PollSelector()
        self.open = 2
        self.selector.register(proc.stdout, selectors.EVENT_READ, True)
        self.selector.register(proc.stderr, selectors.EVENT_READ, False)

    def pump(self, timeout: float) -> bool:
        """Wait at most `timeout` for output (or another registered event), copy what is there;
        False when nothing was ready."""
        ready = self.selector.select(timeout=max(0.0, timeout))
        for key, _ in ready:
            if key.data is None:  # not a pipe: the leader's pidfd
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                self.selector.unregister(key.fileobj)
                self.open -= 1
                continue
            self.log.write(chunk)
            self.capture.add(chunk, stdout=key.data)
            if self.on_output is not None:
                self.on_output()
        return bool(ready)

    def pump_for(self, seconds: float) -> None:
        """Copy output for `seconds` (a process that prints while it stops never blocks on a full pipe)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.pump(left)

    def drain(self) -> None:
        """Copy the rest, once the group is gone: until both pipes close, or until nothing more
        comes for DRAIN_QUIET (a process that escaped the group may still hold a pipe open)."""
        while self.open and self.pump(DRAIN_QUIET):
            pass

    def close(self) -> None:
        self.selector.close()
        self.proc.stdout.close()
        self.proc.stderr.close()


def _feed(proc: subprocess.Popen, text: str) -> None:
    """Write the prompt to stdin in its own thread so a large prompt cannot
    deadlock against a full stdout pipe."""
    data = memoryview(text.encode())
    try:
        while data:  # a raw pipe (bufsize=0) may take part of a write
            data = data[proc.stdin.write(data) :]
    except (BrokenPipeError, OSError):
        pass  # the process does not read its stdin; that is its business
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()
