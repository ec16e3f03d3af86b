"""The workflow layer's effect ledger in a job's journal (issue 10): the keys,
what a record's value holds, and the spawn step's output.

Keys of a workflow job's journal (jobqueue/services/records.py says the rules):

* `step:<id>` done `{output, worker_id, workspace}`: the step succeeded; a
  later attempt in the same workspace (same worker, same path) skips it and
  reuses the output, as long as every step before it was skipped too; after
  a failed finish (`retry-after`) the next run's are `step:<id>:<run>`;
* `publish:<id>` started before the command, done `{output}` after: a done
  publish never runs again, in any workspace; started `{"exited": N}` when
  attempt N's command exited non-zero (its end is known: no retry flag);
* `spawn:<id>` done `{children}`: the spawn step's validated child list, which
  the control plane turns into tasks;
* `checkpoint:<id>` (kept by heartbeats) `{content}`: the step's checkpoint file.

A hook job has a journal of its own, with the same keys: every hook step is
recorded as a publish is (`publish:<id>`), so none runs twice to success.
"""

import json
import re

from jobqueue.types import MAX_RECORD_VALUE_BYTES, WORKER_ID_PATTERN

from . import payload

STEP, PUBLISH, SPAWN = "step:", "publish:", "spawn:"
# started {"attempt": N, "run": k}: attempt N finished failed, the k-th run to; the next attempt starts run k
RETRY_AFTER = "retry-after"
MAX_CHILDREN = 100
MAX_CHILD_TITLE = 500  # characters
CHILD_KEYS = ("id", "title", "body", "payload", "workflows")
_CHILD_ID_RE = re.compile(WORKER_ID_PATTERN + r"\Z")


def run_of(records: dict) -> tuple[int, int]:
    """(the run the next attempt belongs to, the last attempt that finished failed; 0, 0 before any):
    a run is the attempts between two failed finishes; only its own step records are resumed."""
    record = records.get(RETRY_AFTER)
    if record is None:
        return 0, 0
    return int(record.value.get("run", 1)), int(record.value.get("attempt", 0))


def step_key(step_id: str, run: int) -> str:
    """The record of a step's success in run `run` (a `done` record is final, so each run has its own)."""
    return f"{STEP}{step_id}" if run == 0 else f"{STEP}{step_id}:{run}"


class SpawnError(ValueError):
    """A spawn step's output that is not its list of children; the message names the line."""


def json_size(value) -> int:
    """Bytes of `value` as the journal measures it (compact UTF-8 JSON)."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))


def with_output(value: dict, output: str) -> dict:
    """`value` with `output` added, the output cut (ending with a note saying so)
    so the whole record fits the journal's MAX_RECORD_VALUE_BYTES."""
    whole = {**value, "output": output}
    size = json_size(whole)
    if size <= MAX_RECORD_VALUE_BYTES:
        return whole
    note = f"\n[apiary: output cut to fit the journal; {len(output.encode('utf-8', 'replace'))} bytes in all, see the step log]"
    budget = MAX_RECORD_VALUE_BYTES - json_size({**value, "output": note})
    kept = output
    while True:  # JSON escapes make some characters longer than their UTF-8: cut again by the excess
        data = kept.encode("utf-8", "replace")
        kept = data[: max(0, min(len(data), budget))].decode("utf-8", errors="ignore")
        over = json_size({**value, "output": kept + note}) - MAX_RECORD_VALUE_BYTES
        if over <= 0 or not kept:  # (nothing left to cut: the rest of the value alone is too large)
            return {**value, "output": kept + note}
        budget = len(kept.encode("utf-8")) - over


def spawn_children(output: str) -> list[dict]:
    """The children a spawn step's stdout lists: one JSON object per line
    (blank lines ignored) of `id` (a step-id-shaped string, unique), `title`
    (non-empty, at most MAX_CHILD_TITLE characters), and optionally `body`
    (a string), `payload` (an object, as a task payload is bounded) and
    `workflows` (a list of workflow ids); at most MAX_CHILDREN, and the list
    must fit one journal record. SpawnError names the first bad line."""
    children: list[dict] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(output.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"spawn output line {number}"
        try:
            child = json.loads(line)
        except ValueError as exc:
            raise SpawnError(f"{where}: not JSON ({exc.msg}): {line[:80]!r}") from None
        if not isinstance(child, dict):
            raise SpawnError(f"{where}: expected a JSON object, got {type(child).__name__}")
        unknown = sorted(set(child) - set(CHILD_KEYS))
        if unknown:
            raise SpawnError(f"{where}: unknown key {unknown[0]!r}; a child has {', '.join(CHILD_KEYS)}")
        ident = child.get("id")
        if not isinstance(ident, str) or not _CHILD_ID_RE.match(ident):
            raise SpawnError(f"{where}: id must be 1–128 characters of A-Z a-z 0-9 . _ -, got {ident!r:.80}")
        if ident in seen:
            raise SpawnError(f"{where}: id {ident!r} is already on line {seen[ident]}")
        seen[ident] = number
        title = child.get("title")
        if not isinstance(title, str) or not title.strip() or len(title) > MAX_CHILD_TITLE:
            raise SpawnError(f"{where}: title must be a non-empty string of at most {MAX_CHILD_TITLE} characters")
        if "body" in child and not isinstance(child["body"], str):
            raise SpawnError(f"{where}: body must be a string, got {type(child['body']).__name__}")
        if "payload" in child:
            if not isinstance(child["payload"], dict):
                raise SpawnError(f"{where}: payload must be a JSON object, got {type(child['payload']).__name__}")
            try:
                payload.task_payload_check(child["payload"], what=f"{where}: payload")
            except payload.PayloadError as exc:
                raise SpawnError(str(exc)) from None
        workflows = child.get("workflows")
        if "workflows" in child and (
            not isinstance(workflows, list) or not all(isinstance(w, str) and w for w in workflows)
        ):
            raise SpawnError(f"{where}: workflows must be a list of workflow ids")
        if len(children) == MAX_CHILDREN:
            raise SpawnError(f"{where}: more than {MAX_CHILDREN} children")
        children.append(child)
    size = json_size({"children": children})
    if size > MAX_RECORD_VALUE_BYTES:
        raise SpawnError(f"spawn output: {size} bytes of children as JSON, more than the journal's {MAX_RECORD_VALUE_BYTES}")
    return children
