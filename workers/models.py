from django.db import models


class Worker(models.Model):
    """A process that claims jobs: the embedded worker or a remote one.

    `session` changes on every registration; calls carrying an older session
    are answered `session_superseded`. Health is computed from
    `last_heartbeat_at` and `worker_timeout` (workers.selectors), not stored.
    """

    worker_id = models.CharField(primary_key=True, max_length=128)
    pool = models.CharField(max_length=128, null=True, blank=True)
    labels = models.JSONField(default=list)
    capabilities = models.JSONField(default=list)
    capacity = models.PositiveIntegerField(default=1)
    session = models.CharField(max_length=64)
    embedded = models.BooleanField(default=False)
    # What the worker says of itself in its heartbeats...
    draining = models.BooleanField(default=False)
    ready = models.BooleanField(default=True)
    # ...and what an operator asked of it (answered as `drain: true`).
    drain_requested = models.BooleanField(default=False)
    version = models.CharField(max_length=64, blank=True, default="")
    hostname = models.CharField(max_length=255, blank=True, default="")
    pid = models.IntegerField(null=True, blank=True)
    registered_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField()

    class Meta:
        ordering = ["worker_id"]

    def __str__(self) -> str:
        return self.worker_id
