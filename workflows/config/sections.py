"""The top level and its id-keyed lists: agents, workflows (with their steps
and retry policy) and sources, then `settings`.

The order matters: workflows name agents and sources name workflows, so each
list is built before the one that refers to it, and an unknown reference is
reported with the ids that do exist. When a list had an entry whose id could
not be read, references into it are not reported (`_Checker.incomplete`):
the missing id is most likely the one referred to.
"""

import difflib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jobqueue.types import Retry
from workflows.runners import ADAPTER_OF

from .checker import _BAD, _Checker, _default, _describe, _one_of, _seconds
from .schema import (
    _SOURCE_TYPE_KEYS,
    AGENT_KEYS,
    HOOK_KEYS,
    HOOK_STEP_KEYS,
    MAX_ID_LENGTH,
    RETRY_KEYS,
    SOURCE_KEYS,
    SOURCE_TYPES,
    STEP_KEYS,
    TOP_KEYS,
    WORKFLOW_KEYS,
    AgentConfig,
    Config,
    SourceConfig,
    StepConfig,
    WorkflowConfig,
)
from .settings import _settings

# For `runner: codex-cli`: the hint names the runner the user meant.
_ADAPTER_TO_RUNNER = {adapter: runner for runner, adapter in ADAPTER_OF.items() if adapter != runner}
# What an absent retry key means comes from jobqueue.types.Retry, not from here.
_NO_RETRY = Retry()


def _build(check: _Checker, raw: dict, path: Path) -> Config:
    check.mapping(raw, "", TOP_KEYS)
    project = path.parent.name or "default"
    if raw.get("project") is not None:
        project = check.identifier(raw["project"], "project", what="a project name") or project
    agents = _agents(check, raw.get("agents"))
    workflows = _workflows(check, raw.get("workflows"), agents)
    sources = _sources(check, raw.get("sources"), workflows, path.parent)
    settings = _settings(check, raw.get("settings"), project=project, agents=agents, sources=sources)
    return Config(
        path=path,
        project=project,
        settings=settings,
        agents=agents,
        workflows=workflows,
        sources=sources,
        warnings=tuple(check.warnings),
    )


def _unique_id(check: _Checker, entry: dict, path: str, seen: dict[str, str], *, kind: str, section: str) -> str | None:
    """The entry's id, reported when invalid or already used by an earlier entry of the same kind."""
    article = "an" if kind[0] in "aeiou" else "a"
    ident = check.identifier(entry.get("id"), f"{path}.id", what=f"{article} {kind} id")
    if ident is None:
        check.incomplete.add(section)
    if ident is not None and ident in seen:
        check.error(f"{path}.id", f"duplicate {kind} id {ident!r} (first used at {seen[ident]})")
        return None
    if ident is not None:
        seen[ident] = path
    return ident


def _entries(check: _Checker, raw: Any, section: str, what: str) -> Iterable[tuple[str, dict]]:
    if raw is _BAD or (raw is not None and not isinstance(raw, list)):
        check.incomplete.add(section)
    for path, element in check.items(raw, section, what):
        if not isinstance(element, dict):
            check.incomplete.add(section)
            if element is not _BAD:
                check.error(path, f"expected a mapping (one {what[:-1]}), got {_describe(element)}")
            continue
        yield path, element


def _agents(check: _Checker, raw: Any) -> dict[str, AgentConfig]:
    agents: dict[str, AgentConfig] = {}
    seen: dict[str, str] = {}
    for path, entry in _entries(check, raw, "agents", "agents"):
        check.mapping(entry, path, AGENT_KEYS, required=("id", "runner"))
        ident = _unique_id(check, entry, path, seen, kind="agent", section="agents")
        runner = check.choice(entry.get("runner"), f"{path}.runner", ADAPTER_OF, hint=_ADAPTER_TO_RUNNER)
        model = check.string(entry.get("model"), f"{path}.model", empty_is_absent=True)
        command = check.command(entry.get("command"), f"{path}.command")
        if runner == "shell":
            if model is not None:
                check.error(f"{path}.model", "not used by runner shell (it runs `command`); remove it")
            if command is None and f"{path}.command" not in check.failed:
                check.error(f"{path}.command", "required for runner shell (a shell string or an argv list)")
        elif runner is not None and entry.get("command") is not None:
            check.error(f"{path}.command", f"only used by runner shell; runner {runner} runs its own CLI")
        agent = AgentConfig(
            id=ident or "",
            runner=runner or "",
            adapter=ADAPTER_OF.get(runner or "", ""),
            model=model,
            command=command,
            worker_pool=check.word(
                entry.get("worker_pool"), f"{path}.worker_pool", what="a pool name", empty_is_absent=True
            ),
            requires_labels=check.strings(entry.get("requires_labels"), f"{path}.requires_labels", what="label"),
            requires_capabilities=check.strings(
                entry.get("requires_capabilities"), f"{path}.requires_capabilities", what="capability"
            ),
            workspace_affinity=_default(
                check.boolean(entry.get("workspace_affinity"), f"{path}.workspace_affinity"), False
            ),
            env=check.env(entry.get("env"), f"{path}.env"),
        )
        if ident is not None:
            agents[ident] = agent
    return agents


def _known(kind: str, ident: str, known: Iterable[str]) -> str:
    known = sorted(known)
    close = difflib.get_close_matches(ident, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    listing = f"known {kind}s: {_one_of(known)}" if known else f"no {kind}s are defined"
    return f"unknown {kind} {ident!r}{hint}; {listing}"


def _workflows(check: _Checker, raw: Any, agents: Mapping[str, AgentConfig]) -> dict[str, WorkflowConfig]:
    workflows: dict[str, WorkflowConfig] = {}
    seen: dict[str, str] = {}
    for path, entry in _entries(check, raw, "workflows", "workflows"):
        check.mapping(entry, path, WORKFLOW_KEYS, required=("id", "agent", "steps"))
        ident = _unique_id(check, entry, path, seen, kind="workflow", section="workflows")
        agent = check.identifier(entry.get("agent"), f"{path}.agent", what="an agent id")
        if agent is not None and agent not in agents and "agents" not in check.incomplete:
            check.error(f"{path}.agent", _known("agent", agent, agents))
        steps = _steps(check, entry.get("steps"), f"{path}.steps")
        retry = _retry(check, entry.get("retry"), f"{path}.retry")
        hooks = _hooks(check, entry.get("hooks"), f"{path}.hooks")
        workflow = WorkflowConfig(
            id=ident or "",
            agent=agent or "",
            steps=steps,
            timeout=check.duration(entry.get("timeout"), f"{path}.timeout"),
            retry=retry,
            priority=_default(check.integer(entry.get("priority"), f"{path}.priority", minimum=-(2**31)), 0),
            hooks=hooks,
        )
        if ident is not None:
            workflows[ident] = workflow
    return workflows


def _steps(check: _Checker, raw: Any, path: str) -> tuple[StepConfig, ...]:
    if isinstance(raw, list) and not raw:
        check.error(path, "expected at least one step")
    steps: list[StepConfig] = []
    seen: dict[str, str] = {}
    for step_path, entry in _entries(check, raw, path, "steps"):
        check.mapping(entry, step_path, STEP_KEYS, required=("id",))
        ident = _unique_id(check, entry, step_path, seen, kind="step", section=path)
        prompt = check.string(entry.get("prompt"), f"{step_path}.prompt")
        run = check.string(entry.get("run"), f"{step_path}.run")
        given = [k for k in ("prompt", "run") if entry.get(k) is not None]
        if len(given) == 2:
            check.error(
                f"{step_path}.run", "a step has either prompt (sent to the agent) or run (a shell command), not both"
            )
        elif not given:
            check.error(
                f"{step_path}.prompt", "required: a step needs prompt (sent to the agent) or run (a shell command)"
            )
        publish = _default(check.boolean(entry.get("publish"), f"{step_path}.publish"), False)
        spawn = _default(check.boolean(entry.get("spawn"), f"{step_path}.spawn"), False)
        if publish and spawn:
            check.error(
                f"{step_path}.spawn", "a step is either publish (one external effect) or spawn (child tasks), not both"
            )
        elif (publish or spawn) and given == ["prompt"]:
            # The effect ledger fences a command Apiary runs; what an agent does during a prompt is its own.
            key = "publish" if publish else "spawn"
            check.error(
                f"{step_path}.{key}",
                f"only a run step can be {key}: a prompt's effects are the agent's, not one command Apiary can "
                "record; put the external write (or the child list) in a run step",
            )
        steps.append(
            StepConfig(
                id=ident or "",
                prompt=prompt,
                run=run,
                timeout=check.duration(entry.get("timeout"), f"{step_path}.timeout"),
                env=check.env(entry.get("env"), f"{step_path}.env"),
                continue_on_error=_default(
                    check.boolean(entry.get("continue_on_error"), f"{step_path}.continue_on_error"), False
                ),
                publish=publish,
                spawn=spawn,
            )
        )
    return tuple(steps)


def _hooks(check: _Checker, raw: Any, path: str) -> dict[str, tuple[StepConfig, ...]]:
    """`hooks: {on_success|on_failure|on_cancel: [run steps]}` as {terminal job state: steps}."""
    section = check.mapping(raw, path, HOOK_KEYS) or {}
    return {
        state: _hook_steps(check, section[key], f"{path}.{key}")
        for key, state in HOOK_KEYS.items()
        if section.get(key) is not None
    }


# A hook step's history id is `hook:<outcome>:<id>` (workflows.executor), kept beside the instance's step rows.
MAX_HOOK_STEP_ID = MAX_ID_LENGTH - max(len(f"hook:{state}:") for state in HOOK_KEYS.values())


def _hook_steps(check: _Checker, raw: Any, path: str) -> tuple[StepConfig, ...]:
    """A hook's run steps: `run` required, `timeout` and `env` as a step's; ids default to hook-1, hook-2, …"""
    if isinstance(raw, list) and not raw:
        check.error(path, "expected at least one run step (or leave the hook out)")
    steps: list[StepConfig] = []
    seen: dict[str, str] = {}
    for position, (step_path, entry) in enumerate(_entries(check, raw, path, "steps"), start=1):
        # A step key a hook does not take gets its reason, not a bare "unknown key".
        for key in STEP_KEYS:
            if key not in HOOK_STEP_KEYS and key in entry:
                check.error(
                    f"{step_path}.{key}", f"not for a hook step; a hook step is a command: {_one_of(HOOK_STEP_KEYS)}"
                )
        check.mapping(
            {k: v for k, v in entry.items() if k not in STEP_KEYS or k in HOOK_STEP_KEYS},
            step_path,
            HOOK_STEP_KEYS,
            required=("run",),
        )
        if entry.get("id") is None:
            ident = f"hook-{position}"
            if ident in seen:
                check.error(
                    f"{step_path}.id", f"the default id {ident!r} is taken (at {seen[ident]}); give this step an id"
                )
                ident = None
            else:
                seen[ident] = step_path
        else:
            ident = _unique_id(check, entry, step_path, seen, kind="step", section=path)
            if ident is not None and len(ident) > MAX_HOOK_STEP_ID:
                check.error(
                    f"{step_path}.id",
                    f"a hook step id is at most {MAX_HOOK_STEP_ID} characters (its history row is "
                    f"hook:<outcome>:<id>, at most {MAX_ID_LENGTH}), got {len(ident)}",
                )
        steps.append(
            StepConfig(
                id=ident or "",
                run=check.string(entry.get("run"), f"{step_path}.run"),
                timeout=check.duration(entry.get("timeout"), f"{step_path}.timeout"),
                env=check.env(entry.get("env"), f"{step_path}.env"),
            )
        )
    return tuple(steps)


def _retry(check: _Checker, raw: Any, path: str) -> Retry:
    section = check.mapping(raw, path, RETRY_KEYS) or {}
    max_attempts = check.integer(section.get("max_attempts"), f"{path}.max_attempts", minimum=1)
    backoff = check.duration(section.get("backoff"), f"{path}.backoff", allow_zero=True)
    backoff_max = check.duration(section.get("backoff_max"), f"{path}.backoff_max", allow_zero=True)
    if backoff is not None and backoff_max is not None and backoff_max < backoff:
        check.error(
            f"{path}.backoff_max", f"expected at least backoff ({_seconds(backoff)}), got {_seconds(backoff_max)}"
        )
    return Retry(
        max_attempts=_default(max_attempts, _NO_RETRY.max_attempts),
        backoff=_default(backoff, _NO_RETRY.backoff),
        backoff_max=_default(backoff_max, _NO_RETRY.backoff_max),
    )


def _sources(check: _Checker, raw: Any, workflows: Mapping[str, WorkflowConfig], base: Path) -> dict[str, SourceConfig]:
    sources: dict[str, SourceConfig] = {}
    seen: dict[str, str] = {}
    for path, entry in _entries(check, raw, "sources", "sources"):
        check.mapping(entry, path, SOURCE_KEYS, required=("id", "type", "workflows"))
        ident = _unique_id(check, entry, path, seen, kind="source", section="sources")
        kind = check.choice(entry.get("type"), f"{path}.type", SOURCE_TYPES)
        if kind is not None:
            for other, keys in _SOURCE_TYPE_KEYS.items():
                for key in keys:
                    if other != kind and entry.get(key) is not None:
                        check.error(f"{path}.{key}", f"only for sources of type {other}; this source is type {kind}")
        names = _source_workflows(check, entry.get("workflows"), f"{path}.workflows", workflows)
        poll = _default(check.duration(entry.get("poll_interval"), f"{path}.poll_interval"), 30.0)
        directory = None
        command = None
        if kind == "directory":
            directory = _source_path(check, entry.get("path"), f"{path}.path", base)
        elif kind == "command":
            command = check.command(entry.get("command"), f"{path}.command")
            if entry.get("command") is None:
                check.error(f"{path}.command", "required for a command source (a shell string or an argv list)")
        source = SourceConfig(
            id=ident or "",
            type=kind or "",
            workflows=names,
            poll_interval=poll,
            path=directory,
            pattern=_default(check.string(entry.get("pattern"), f"{path}.pattern"), "*"),
            redispatch_on_change=_default(
                check.boolean(entry.get("redispatch_on_change"), f"{path}.redispatch_on_change"), False
            ),
            command=command,
        )
        if ident is not None:
            sources[ident] = source
    return sources


def _source_workflows(check: _Checker, raw: Any, path: str, workflows: Mapping[str, WorkflowConfig]) -> tuple[str, ...]:
    if isinstance(raw, list) and not raw:
        check.error(path, "expected at least one workflow id")
    names: list[str] = []
    for item_path, item in check.items(raw, path, "workflow ids"):
        name = check.identifier(item, item_path, what="a workflow id")
        if name is None:
            continue
        if name in names:
            check.error(item_path, f"workflow {name!r} is listed twice")
        elif name not in workflows and "workflows" not in check.incomplete:
            check.error(item_path, _known("workflow", name, workflows))
        else:
            names.append(name)
    return tuple(names)


def _source_path(check: _Checker, raw: Any, path: str, base: Path) -> Path | None:
    text = check.string(raw, path)
    if text is None:
        if raw is None:
            check.error(path, "required for a directory source (a folder, relative to the config file)")
        return None
    folder = Path(os.path.normpath(base / Path(text).expanduser()))
    if not folder.exists():
        check.warn(path, f"folder {str(folder)!r} does not exist (yet); the source finds nothing until it does")
    elif not folder.is_dir():
        check.error(path, f"expected a folder, but {str(folder)!r} is a file")
    return folder
