from django.db import models


class TaskState(models.TextChoices):
    """A task's state is derived, never stored: it is its newest generation's
    jobs' (workflows.selectors.task_states), so it cannot drift from them."""

    OPEN = "open"
    """No job was dispatched for the newest generation (yet)."""
    ACTIVE = "active"
    """Some job of the newest generation is queued or leased."""
    SUCCEEDED = "succeeded"
    """Every job of the newest generation ended, the last to end succeeded."""
    FAILED = "failed"
    """Every job of the newest generation ended, the last to end failed."""
    CANCELLED = "cancelled"
    """Every job of the newest generation ended, the last to end was cancelled."""


class Task(models.Model):
    """One source item. A changed item starts a new `generation`; each
    generation dispatches every workflow of its source once (enqueue key
    `task:generation:workflow`)."""

    source = models.CharField(max_length=128)
    item_key = models.CharField(max_length=1024)
    generation = models.PositiveIntegerField(default=1)
    title = models.TextField(blank=True, default="")
    body = models.TextField(blank=True, default="")
    payload = models.JSONField(default=dict, blank=True)
    content_hash = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["source", "item_key"], name="task_source_item_unique")]

    def __str__(self) -> str:
        return f"{self.source}:{self.item_key}"


class WorkflowInstance(models.Model):
    """One run of a workflow on one generation of a task. Its job is the
    queue's record of it: the instance's state, summary and error are the
    job's (`instance.job.state`), never a copy. `job` is set in the
    transaction that creates the instance (workflows.services.dispatch)."""

    # No index of its own: the unique (task, generation, workflow) below leads with it.
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="instances", db_index=False)
    generation = models.PositiveIntegerField()
    workflow = models.CharField(max_length=128)
    job = models.OneToOneField("queue.Job", null=True, on_delete=models.CASCADE, related_name="+")
    # The instance whose spawn step created this instance's task (workflows.spawning), set when
    # this instance is dispatched. On the instance, not the task: a child task's later generation
    # (a later parent generation spawning it with new content) is dispatched by that parent
    # instance, and each instance names the one that caused it. null for a source's own task.
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children",
        help_text="the instance whose spawn step created this one's task",
    )  # fmt: skip
    created_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["task", "generation", "workflow"], name="instance_task_gen_workflow_unique")
        ]

    def __str__(self) -> str:
        return f"{self.workflow}#{self.pk} ({self.task})"


class Spawn(models.Model):
    """A done `spawn:<step>` record of a job's journal that the control plane
    has materialised into child tasks (workflows.spawning): one row per
    record, written in the transaction that creates the children, so each
    record is materialised once. The record itself is the queue's and stays
    as the worker wrote it."""

    job = models.ForeignKey("queue.Job", on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)  # the record's key, `spawn:<step>`
    instance = models.ForeignKey(
        WorkflowInstance, null=True, blank=True, on_delete=models.SET_NULL, related_name="spawns",
        help_text="the spawning instance (none for a job that is no instance's)",
    )  # fmt: skip
    children = models.PositiveIntegerField(default=0, help_text="the children taken (not skipped)")
    materialised_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "key"], name="spawn_job_key_unique")]

    def __str__(self) -> str:
        return f"job {self.job_id} {self.key}"


class StepRun(models.Model):
    """History of one step of one attempt of an instance. The embedded worker
    writes it here; a remote worker keeps it in its own history database and
    sends the summary with its finish."""

    # No index of its own: the unique (instance, attempt_number, step_id) below leads with it.
    instance = models.ForeignKey(WorkflowInstance, on_delete=models.CASCADE, related_name="steps", db_index=False)
    attempt_number = models.PositiveIntegerField()
    step_id = models.CharField(max_length=128)
    status = models.CharField(max_length=16)  # running, succeeded, failed, cancelled, timed_out, skipped
    worker_id = models.CharField(max_length=128, blank=True, default="")
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    log_path = models.CharField(max_length=1024, blank=True, default="")
    output_tail = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["instance", "attempt_number", "started_at", "id"]
        constraints = [
            models.UniqueConstraint(fields=["instance", "attempt_number", "step_id"], name="steprun_unique")
        ]

    def __str__(self) -> str:
        return f"{self.instance_id}/{self.attempt_number}/{self.step_id} [{self.status}]"
