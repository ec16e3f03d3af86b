"""The embedded worker's step history store (see executor.History)."""

import datetime as dt

from jobqueue.types import Claim

from . import payload
from .models import StepRun


class DatabaseHistory:
    """The embedded worker writes step history straight into the control
    plane's database. StepRun rows are history, not queue state."""

    def step_started(self, *, claim: Claim, worker_id: str, step_id: str, started_at: dt.datetime, log_path: str) -> None:
        StepRun.objects.update_or_create(
            instance_id=payload.read(claim).instance_id,
            attempt_number=claim.attempt_number,
            step_id=step_id,
            defaults={"status": "running", "worker_id": worker_id, "started_at": started_at, "log_path": log_path},
        )

    def step_finished(self, *, claim: Claim, worker_id: str, step_id: str, result) -> None:
        StepRun.objects.filter(
            instance_id=payload.read(claim).instance_id, attempt_number=claim.attempt_number, step_id=step_id
        ).update(status=result.status, ended_at=result.ended_at, exit_code=result.exit_code, output_tail=result.output_tail)
