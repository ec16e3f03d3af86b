"""Runs one claimed job: the workflow's steps, in order, in the task's workspace.

The executor knows nothing of leases or transports: it gets a claim, a
cancel event and the SIGTERM→SIGKILL grace, runs each step through the
runner adapters, records step history, and returns the outcome. It is what
the worker runtime's `Executor` protocol (workers.runtime) asks for; the
runtime decides what to do with the outcome.
"""

import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Protocol

from jobqueue.text import clean
from jobqueue.types import CHECKPOINT_PREFIX, Claim
from workers import private
from workers.claimcheck import PathOutside, inside, inside_each
from workers.executor import Outcome
from workers.journal import Checkpoint, Journal, JournalError
from workers.pgroups import ProcessGroups

from . import effects, payload, runners, templates
from .config import Config, StepConfig

log = logging.getLogger("apiary.worker")


class History(Protocol):
    """Where step history goes: the control plane's database for the embedded
    worker, the worker's own SQLite file for a remote one."""

    def step_started(self, *, claim: Claim, worker_id: str, step_id: str, started_at: dt.datetime, log_path: str) -> None: ...

    def step_finished(self, *, claim: Claim, worker_id: str, step_id: str, result: "runners.StepResult") -> None: ...


# Variables of the worker's own environment that no step gets. A step runs task-driven (often
# agent-driven) code, and with these it could act as the worker on the protocol
# (APIARY_WORKER_TOKEN, which `apiary worker` and `${APIARY_WORKER_TOKEN}` in a config read),
# open the queue database directly (DATABASE_URL) or forge admin sessions (DJANGO_SECRET_KEY).
# Which other variables a config interpolated is not knowable here, so only these are named; a
# step that needs one of them can still be given it explicitly with `env:` in the config.
# PROMETHEUS_MULTIPROC_DIR (jobqueue.metrics) too: a step using prometheus-client would otherwise
# add its own metrics to the control plane's.
WITHHELD_ENV = ("APIARY_WORKER_TOKEN", "DATABASE_URL", "DJANGO_SECRET_KEY", "PROMETHEUS_MULTIPROC_DIR")

# Bytes (UTF-8) of one task text variable. Linux refuses to start a process when one environment
# string exceeds 128 KiB (E2BIG) or all of them exceed a quarter of the stack limit; a cut far
# below both leaves room for the rest of the environment. APIARY_TASK_FILE has everything.
TASK_TEXT_CAP = 32 * 1024


def task_environment(
    claim: Claim, job: payload.WorkflowJob, *, worker_id: str, workspace: Path, task_file: Path, task: dict
) -> dict[str, str]:
    """Identity and task fields for every step process. Task text travels in
    the environment, never spliced into a command line.

    An environment cannot hold every task: NUL (and a lone surrogate, which
    cannot be encoded) becomes U+FFFD, and APIARY_TASK_TITLE, _BODY, _PAYLOAD
    (JSON) and _ITEM_KEY are cut to TASK_TEXT_CAP bytes at a character
    boundary, ending with a note saying so. APIARY_TASK_FILE names a JSON file
    with the whole task, unchanged and uncut (`task_file_bytes`); read it when
    the text may be long: `jq -r .body "$APIARY_TASK_FILE"`. `task` is job.task cleaned so
    (`clean`), once for this and the step templates."""
    env = {
        "APIARY_JOB_ID": str(claim.job_id),
        "APIARY_ATTEMPT": str(claim.attempt_number),
        "APIARY_INSTANCE_ID": str(job.instance_id),
        "APIARY_WORKER_ID": worker_id,
        "APIARY_WORKSPACE": str(workspace),
        "APIARY_WORKFLOW": job.workflow,
        "APIARY_TASK_ID": str(task["id"]),
        "APIARY_TASK_SOURCE": str(task.get("source", "")),
        "APIARY_TASK_ITEM_KEY": _capped(str(task.get("item_key", ""))),
        "APIARY_TASK_GENERATION": str(task.get("generation", "")),
        "APIARY_TASK_TITLE": _capped(str(task.get("title", ""))),
        "APIARY_TASK_BODY": _capped(str(task.get("body", ""))),
        "APIARY_TASK_PAYLOAD": _capped(json.dumps(task.get("payload", {}))),
        "APIARY_TASK_FILE": str(task_file),
    }
    return _safe(env)


def task_file_bytes(task: dict) -> bytes:
    """The whole task as JSON, for APIARY_TASK_FILE. A lone surrogate is
    written as its JSON escape (\\udXXX), so the file is always valid UTF-8 JSON. One line, not
    indented: the json module's C encoder writes only that (with `indent` it is pure Python,
    three times as slow), and jq or any reader takes both alike."""
    text = json.dumps(task, ensure_ascii=False, default=str)
    return (text + "\n").encode("utf-8", errors="backslashreplace")


def _capped(text: str, *, whole: str = "$APIARY_TASK_FILE") -> str:
    data = text.encode("utf-8", errors="replace")  # lone surrogates are already U+FFFD
    if len(data) <= TASK_TEXT_CAP:
        return text
    note = f"\n[apiary: truncated to fit the environment; {len(data)} bytes in all, see {whole}]"
    # errors="ignore" drops the partial character the byte cut may leave at the end.
    kept = data[: TASK_TEXT_CAP - len(note.encode())].decode("utf-8", errors="ignore")
    return kept + note


# NUL, and surrogates other than the U+DC80..U+DCFF that os.environ uses for undecodable bytes
# (os.fsencode turns those back into the bytes; any other surrogate cannot be encoded at all).
_NOT_IN_ENV = re.compile("[\x00\ud800-\udc7f\udd00-\udfff]")


def _env_safe(value: str) -> str:
    """execve takes neither NUL nor text that does not encode; the step would not start."""
    return _NOT_IN_ENV.sub("\ufffd", value)


def _safe(env: dict[str, str]) -> dict[str, str]:
    return {name: _env_safe(value) for name, value in env.items()}


# The output tail of a skipped step's history row: why it did not run (Executor._reused).
SKIPPED_NOTES = {
    "step": "apiary: skipped, its success was recorded by an earlier attempt in this workspace; output reused",
    "publish": "apiary: skipped, this publish was recorded done by an earlier attempt; output reused",
    "spawn": "apiary: skipped, this spawn's children were recorded by an earlier attempt",
    "hook": "apiary: skipped, this hook step was recorded done by an earlier attempt; output reused",
}



class Executor:
    """Runs a workflow job's steps, or a hook job's, through the job's journal
    (workers/journal.py; the keys are workflows/effects.py's): a step whose
    success this worker recorded in this workspace is skipped, a done publish,
    hook step or spawn is never run again, each step's checkpoint file is pre-filled from
    the journal. Without a journal (a direct call) nothing is read or recorded."""

    def __init__(self, *, config: Config, worker_id: str, history: History, groups: ProcessGroups):
        self.config = config
        self.worker_id = worker_id
        self.history = history
        self.groups = groups
        # The worker's environment as steps inherit it, less WITHHELD_ENV, with each agent's `env`
        # over it, made safe for execve once: taken as the executor is made (a worker sets its
        # environment up before), not copied and cleaned again for every job and step.
        inherited = {name: value for name, value in os.environ.items() if name not in WITHHELD_ENV}
        self._agent_env = {
            agent_id: _safe({**inherited, **agent.env}) for agent_id, agent in config.agents.items()
        }

    def run(self, claim: Claim, cancel: threading.Event, *, grace: float, journal: Journal | None = None) -> Outcome:
        try:
            job = payload.read(claim)
        except payload.PayloadError as exc:
            return Outcome("failed", {}, str(exc))
        workflow = self.config.workflows.get(job.workflow)
        if workflow is None:
            return Outcome("failed", {}, f"workflow {job.workflow!r} is not in this worker's config")
        if isinstance(job, payload.HookJob):
            # The hook job's steps are its own: its journal, its outcome; the instance is untouched.
            steps = workflow.hooks.get(job.outcome, ())
            if not steps:  # the hook was removed from the config after dispatch: nothing to run
                log.info("job %s: workflow %s has no %s hook any more; nothing to run", claim.job_id, job.workflow, job.outcome)
            prefix = f"hook:{job.outcome}:"
        else:
            steps, prefix = workflow.steps, ""
        agent = self.config.agents[workflow.agent]
        state = self.config.state_dir
        try:
            # Claim data makes these paths: none may resolve outside the state directory (symlinks too).
            workspace = inside(state, "workspaces", str(job.task["id"]))
            # Checkpoints are per instance (two workflows of a task share its workspace) and outside the
            # workspace (a git checkout there would see them as untracked): beside the instance's logs,
            # since a directory of their own would be one more inode a job, and on a file system without
            # a journal (ext4 without one skips inodes freed in the last minutes: bench/README.md) a new
            # inode is costly.
            names = [
                f"task-{_file_name(prefix)}{claim.attempt_number}.json",
                *(f"{_file_name(prefix + step.id)}.log" for step in steps),
                *(f"{_file_name(prefix + step.id)}.checkpoint" for step in steps),
            ]
            logs, (task_file, *files) = inside_each(state, ("logs", str(job.instance_id)), names)
            step_logs = dict(zip((step.id for step in steps), files[: len(steps)], strict=True))
            checkpoints = dict(zip((step.id for step in steps), files[len(steps) :], strict=True))
        except PathOutside as exc:
            return Outcome("failed", {}, f"job {claim.job_id}: refused a path from its claim: {exc}")
        workspace.mkdir(parents=True, exist_ok=True)
        try:
            new_logs = private.made_private_dir(logs)
            private.write_private(task_file, task_file_bytes(job.task))
        except OSError as exc:
            return Outcome("failed", {}, f"cannot write the task file {task_file}: {exc}")
        task = clean(dict(job.task))
        task_env = task_environment(
            claim, job, worker_id=self.worker_id, workspace=workspace, task_file=task_file, task=task
        )
        if isinstance(job, payload.HookJob):
            task_env |= _safe({"APIARY_HOOK_OUTCOME": job.outcome, "APIARY_EFFECT_KEY": job.effect_key})
        base_env = {**self._agent_env[workflow.agent], **task_env}  # safe already, both
        # Rendered prompts and commands become argv and environment strings, which hold no NUL.
        context = {"task": task, "steps": {}, "workflow": job.workflow, "attempt": claim.attempt_number}
        deadline = time.monotonic() + workflow.timeout if workflow.timeout else None
        steps_summary: list[dict] = []
        outcome, error = "succeeded", None
        run = _Run(
            claim=claim, job=job, journal=journal, workspace=workspace, records={}, cancel=cancel, grace=grace,
            agent=agent, base_env=base_env, context=context, summary=steps_summary, new_logs=new_logs,
        )
        try:
            if journal is not None and claim.attempt_number > 1:
                # The journal is written only through the job's attempts, and attempt 1 is the job's
                # first (a retry numbers its attempts after the last), so before attempt 2 it is empty.
                run.records = journal.records()
                run.run_index = effects.run_of(run.records)[0]
            for step in steps:
                if cancel.is_set():
                    outcome, error = "cancelled", "cancelled before step " + step.id
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    outcome, error = "failed", f"workflow timeout ({workflow.timeout:g}s) reached before step {step.id}"
                    break
                failed = self._step(
                    run, step, history_id=prefix + step.id, remaining=remaining,
                    log_path=step_logs[step.id], checkpoint=checkpoints[step.id], last=step is steps[-1],
                )
                if failed is not None:
                    outcome, error = failed
                    break
        except JournalError as exc:
            # Stale: the runtime discards this result (the journal told it); the rest runs nothing more.
            outcome, error = "failed", str(exc)
        else:
            if outcome == "failed" and journal is not None:
                # A failed run is finished, not interrupted: a retry starts over (done publishes and
                # spawns stay done). Only an attempt that ended without finishing resumes.
                next_run = effects.run_of(run.records)[0] + 1
                with contextlib.suppress(JournalError):
                    journal.record(effects.RETRY_AFTER, "started", {"attempt": claim.attempt_number, "run": next_run})
        summary = {"steps": steps_summary, "worker_id": self.worker_id, "attempt": claim.attempt_number}
        return Outcome(outcome, summary, error)

    def _step(
        self, run: "_Run", step: StepConfig, *, history_id: str, remaining: float | None, log_path: Path,
        checkpoint: Path, last: bool,
    ) -> tuple[str, str] | None:
        """Run (or skip) one step; (outcome, error) when the job must stop here."""
        reused = self._reused(run, step)
        if reused is not None:
            why, output = reused
            log.info("job %s: step %s skipped (%s recorded); its output reused", run.claim.job_id, history_id, why)
            self._skipped(run, step, history_id, why, output)
            return None
        run.resuming = False  # a step runs: every plain step after it runs too (their inputs may change)
        try:
            argv, stdin, extra_env = self._command(run.agent, step, run.context)
        except templates.TemplateError as exc:
            run.summary.append({"id": history_id, "status": "failed", "error": str(exc)})
            return "failed", f"step {step.id}: {exc}"
        timeout = min(t for t in (step.timeout, remaining) if t is not None) if (step.timeout or remaining) else None
        if "APIARY_PROMPT" in extra_env:  # the shell adapter's copy; stdin has the whole prompt
            extra_env = {**extra_env, "APIARY_PROMPT": _capped(extra_env["APIARY_PROMPT"], whole="stdin")}
        effect_env = {"APIARY_STEP_ID": step.id, **self._checkpoint_prepared(run, step, checkpoint)}
        if (step.publish or step.spawn) and run.journal is None:
            error = (
                f"step {step.id} is a {'publish' if step.publish else 'spawn'} step and the control plane keeps no "
                "journal for it (it predates effect steps): upgrade the control plane"
            )
            run.summary.append({"id": history_id, "status": "failed", "error": error})
            return "failed", error
        if isinstance(run.job, payload.WorkflowJob) and (step.publish or step.spawn):
            effect_env["APIARY_EFFECT_KEY"] = payload.step_effect_key(
                project=self.config.project, job=run.job, step_id=step.id
            )
        once = self._once(run, step)
        if once is not None and run.journal is not None:
            before = run.records.get(effects.PUBLISH + step.id)
            # Fenced: a stale attempt records nothing (JournalError), so it never runs the command.
            started = run.journal.record(effects.PUBLISH + step.id, "started", {})
            if started.already_done:  # another attempt finished it meanwhile
                self._skipped(run, step, history_id, once, str(started.value.get("output", "")))
                return None
            exited = before is not None and "exited" in before.value  # the last run's end is known: it failed
            if started.started_earlier and not exited:  # its end is unknown: run again, and say so
                effect_env["APIARY_EFFECT_RETRY"] = "1"
        env = {**run.base_env, **_safe({**step.env, **extra_env, **effect_env})}
        result = self._execute(run, history_id, argv, stdin=stdin, env=env, timeout=timeout, log_path=log_path, checkpoint=checkpoint, step_id=step.id)
        spawn_error = None
        if result.status == "succeeded":
            if step.spawn:
                try:
                    children = effects.spawn_children(result.output)
                except effects.SpawnError as exc:
                    spawn_error = str(exc)
                    result = dataclasses.replace(result, status="failed")
                else:
                    self._record(run, effects.SPAWN + step.id, {"children": children})
            if once is not None:
                self._record(run, effects.PUBLISH + step.id, effects.with_output({}, result.output))
            if result.status == "succeeded":
                value = {"worker_id": self.worker_id, "workspace": str(run.workspace)}
                key, value = effects.step_key(step.id, run.run_index), effects.with_output(value, result.output)
                if last and run.journal is not None:  # nothing runs after it but the job's finish
                    run.journal.record_before_finish(key, "done", value)
                else:
                    self._record(run, key, value)
        elif result.status == "failed" and once is not None and run.journal is not None:
            # It exited non-zero: its end is known, so the next run of it is no retry of an unknown end.
            run.journal.record(effects.PUBLISH + step.id, "started", {"exited": run.claim.attempt_number})
        run.context["steps"][step.id] = {"output": result.output, "exit_code": result.exit_code, "status": result.status}
        entry = {
            "id": history_id,
            "status": result.status,
            "exit_code": result.exit_code,
            "duration": round(result.duration, 3),
            "output_tail": result.output_tail[-1000:],
        }
        if spawn_error:
            entry["error"] = spawn_error
        run.summary.append(entry)
        if result.status == "cancelled":
            return "cancelled", f"step {step.id} was cancelled"
        if spawn_error:
            return "failed", f"step {step.id}: {spawn_error}"
        if result.status != "succeeded" and not step.continue_on_error:
            why = "timed out" if result.status == "timed_out" else f"exited with {result.exit_code}"
            return "failed", f"step {step.id} {why}"
        return None

    def _skipped(self, run: "_Run", step: StepConfig, history_id: str, why: str, output: str) -> None:
        """A step the journal says is done: its recorded output is reused, and its history row
        says `skipped` and why, so status and the admin show it."""
        run.context["steps"][step.id] = {"output": output, "exit_code": 0, "status": "succeeded"}
        run.summary.append({"id": history_id, "status": "skipped", "reused": why})
        now = dt.datetime.now(dt.UTC)
        self.history.step_started(claim=run.claim, worker_id=self.worker_id, step_id=history_id, started_at=now, log_path="")
        self.history.step_finished(
            claim=run.claim, worker_id=self.worker_id, step_id=history_id,
            result=runners.StepResult(
                status="skipped", exit_code=None, started_at=now, ended_at=now, duration=0.0,
                log_path="", output="", output_tail=SKIPPED_NOTES[why],
            ),
        )

    def _reused(self, run: "_Run", step: StepConfig) -> tuple[str, str] | None:
        """(what was recorded, the output to reuse) when the step must not run again: a done
        publish, hook step or spawn (anywhere), or, while every step before it was skipped, a
        success this worker recorded in this workspace in this run (a retry after a failed finish
        is a new run and starts over)."""
        done = {key: r for key, r in run.records.items() if r.state == "done"}
        recorded_step = done.get(effects.step_key(step.id, run.run_index))
        once = self._once(run, step)
        if once is not None and effects.PUBLISH + step.id in done:
            return once, str(done[effects.PUBLISH + step.id].value.get("output", ""))
        if step.spawn and effects.SPAWN + step.id in done:
            if recorded_step is not None:
                return "spawn", str(recorded_step.value.get("output", ""))
            # The worker died between the two records: its output was the children's lines.
            children = done[effects.SPAWN + step.id].value.get("children", [])
            return "spawn", "\n".join(json.dumps(child, ensure_ascii=False) for child in children)
        if run.resuming and recorded_step is not None and (
            recorded_step.value.get("worker_id") == self.worker_id
            and recorded_step.value.get("workspace") == str(run.workspace)
        ):
            return "step", str(recorded_step.value.get("output", ""))
        return None

    @staticmethod
    def _once(run: "_Run", step: StepConfig) -> str | None:
        """"publish" or "hook" for a step whose success must happen at most once (a publish step,
        every step of a hook job: both are recorded as `publish:<id>`), else None."""
        if isinstance(run.job, payload.HookJob):
            return "hook"
        return "publish" if step.publish else None

    def _checkpoint_prepared(self, run: "_Run", step: StepConfig, path: Path) -> dict[str, str]:
        """APIARY_CHECKPOINT (and APIARY_RESUMED=1 when the journal had content for it): the file
        is pre-filled from the journal's `checkpoint:<id>`, or absent; heartbeats send its content."""
        # The folder made for this run holds nothing before its first step starts: no folder to
        # make again, no file left by an earlier run to remove.
        fresh, run.new_logs = run.new_logs, False
        if not fresh:
            private.private_dir(path.parent)
        record = run.records.get(CHECKPOINT_PREFIX + step.id)
        content = record.value.get("content") if record is not None else None
        if record is not None and any(
            (done := run.records.get(effects.step_key(step.id, k))) is not None
            and done.attempt_number >= record.attempt_number
            for k in range(run.run_index + 1)
        ):
            # The step succeeded after it was kept (it runs again only because that was elsewhere or
            # before a failed finish): that session is over, so this run of the step starts fresh.
            content = None
        env = {"APIARY_CHECKPOINT": str(path)}
        if isinstance(content, str):
            private.write_private(path, content.encode("utf-8", errors="replace"))
            env["APIARY_RESUMED"] = "1"
            if run.journal is not None:
                run.journal.checkpoint_sent((step.id, content))  # the control plane has it already
        elif not fresh:
            path.unlink(missing_ok=True)
        return env

    def _record(self, run: "_Run", key: str, value: dict) -> None:
        if run.journal is not None:
            run.journal.record(key, "done", value)

    def _execute(self, run: "_Run", history_id: str, argv, *, stdin, env, timeout, log_path: Path, checkpoint: Path, step_id: str):
        started = dt.datetime.now(dt.UTC)
        self.history.step_started(
            claim=run.claim, worker_id=self.worker_id, step_id=history_id, started_at=started, log_path=str(log_path)
        )
        spawned: list[int] = []

        def on_spawn(pgid: int, spawned=spawned) -> None:
            self.groups.add(pgid)
            spawned.append(pgid)

        if run.journal is not None:
            run.journal.checkpoint = Checkpoint(step_id, checkpoint)
        # The step's output streams to the control plane from where its log file ends now (earlier
        # attempts appended to the same file), on the sender's thread: the step never waits for it.
        logs = run.journal.logs if run.journal is not None else None
        if logs is not None:
            logs.step_started(history_id, log_path)
        result = None
        try:
            result = runners.run_step(
                argv,
                cwd=run.workspace,
                env=env,
                stdin=stdin,
                log_path=log_path,
                timeout=timeout,
                cancel=run.cancel,
                grace=run.grace,
                on_spawn=on_spawn,
                on_output=logs.output_written if logs is not None else None,
            )
        except Exception as exc:
            # run_step reports the step's own failures as a result; this is ours (a log or
            # process-group record that cannot be written, an argument the OS refuses). The
            # step's history row must still be finished, or it shows `running` forever.
            log.exception("step %s of instance %s could not be run", history_id, run.job.instance_id)
            result = _unstarted(log_path, started, f"apiary: step {history_id} could not be run: {exc!r}")
        finally:
            if logs is not None:
                logs.step_ended(history_id)
            if run.journal is not None:
                if result is None or result.status != "succeeded":  # the next attempt of this step starts from it
                    run.journal.checkpoint_flush()
                run.journal.checkpoint = None
        for pgid in spawned:  # run_step ended the whole group, background children too
            self.groups.remove(pgid)
        self.history.step_finished(claim=run.claim, worker_id=self.worker_id, step_id=history_id, result=result)
        return result

    def _command(self, agent, step: StepConfig, context: dict) -> tuple[list[str], str | None, dict]:
        if step.prompt is not None:
            return runners.build_prompt_command(agent, templates.render(step.prompt, context))
        # Placeholders become "$APIARY_T_n" and their values travel in the environment: the shell
        # never parses task text (README, design notes: "A run command never holds task text").
        command, values = templates.render_command(step.run, context)
        return runners.build_run_command(command), None, values


@dataclasses.dataclass
class _Run:
    """What the steps of one run share."""

    claim: Claim
    job: "payload.WorkflowJob | payload.HookJob"
    journal: Journal | None
    workspace: Path
    records: dict
    cancel: threading.Event
    grace: float
    agent: object
    base_env: dict
    context: dict
    summary: list
    run_index: int = 0  # effects.run_of: the run this attempt belongs to
    resuming: bool = True  # no step has run yet in this attempt: recorded ones may still be skipped
    new_logs: bool = False  # the logs folder was made for this run and no step has started: it is empty


def _file_name(step_id: str) -> str:
    """A history step id as a file name (hook step ids hold colons)."""
    return step_id.replace(":", "-")


def _unstarted(log_path: Path, started: dt.datetime, message: str) -> runners.StepResult:
    """A failed result for a step that raised instead of reporting, with the
    reason in its log (when the log can be written) and its output tail."""
    with contextlib.suppress(OSError), private.open_private(log_path, "a", encoding="utf-8") as log_file:
        log_file.write(message + "\n")
    ended = dt.datetime.now(dt.UTC)
    return runners.StepResult(
        status="failed", exit_code=None, started_at=started, ended_at=ended,
        duration=(ended - started).total_seconds(), log_path=str(log_path), output="", output_tail=message,
    )
