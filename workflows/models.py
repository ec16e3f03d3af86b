from django.db import models


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
    # The outcome of the newest generation's workflows, kept in step with the
    # jobs by the queue services and repaired by reconciliation.
    state = models.CharField(max_length=16, default="open")
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["source", "item_key"], name="task_source_item_unique")]

    def __str__(self) -> str:
        return f"{self.source}:{self.item_key}"


class WorkflowInstance(models.Model):
    """One run of a workflow on one generation of a task; its job is the
    queue's record of it. `state` mirrors the job once the job is terminal."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="instances")
    generation = models.PositiveIntegerField()
    workflow = models.CharField(max_length=128)
    state = models.CharField(max_length=16, default="pending")
    summary = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["task", "generation", "workflow"], name="instance_task_gen_workflow_unique")
        ]

    def __str__(self) -> str:
        return f"{self.workflow}#{self.pk} ({self.task})"


class StepRun(models.Model):
    """History of one step of one attempt of an instance. The embedded worker
    writes it here; a remote worker keeps it in its own history database and
    sends the summary with its finish."""

    instance = models.ForeignKey(WorkflowInstance, on_delete=models.CASCADE, related_name="steps")
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
