"""Every state change of the queue, one durable transaction each.

Views, admin actions, commands and the worker runtime call these functions;
nothing else writes queue rows. Each takes `now` from the injected clock
(`clock=` or jobqueue.clock's current clock), raises domain errors from
jobqueue.exceptions, and writes a JobEvent row per job transition in the same
transaction. Job and attempt states move only through
`services.transitions` (a compare-and-set with a row count check).

    jobs.py       job_enqueue (and job_enqueue_in, inside a caller's transaction; jobs_enqueue_in, many
                  at once), job_cancel, job_retry
    claiming.py   jobs_claim (claim_round: the same, with what a long-poll needs to wait)
    attempts.py   attempt_heartbeat, attempt_finish, attempt_abandon, leases_expire, reconcile
    chaining.py   attempt_finish_and_claim (a finish that claims the worker's next job in its transaction,
                  and carries the job's last record and log ends under its fence)
    workers.py    worker_register, worker_heartbeat, worker_drain, worker_undrain, workers_forget,
                  worker_forget (an operator's)
    credentials.py  worker_enroll, worker_reregister (who may register an id), credential_issue,
                  credential_used, credentials_revoke
    affinity.py   affinity_release (and the pin a claim takes)
    records.py    job_record, job_records, attempt_heartbeat_with_checkpoint (a job's journal), record_of_job, records_of_job
    logs.py       log_append (a running step's output, streamed by its attempt), logs_prune
"""

from .affinity import affinity_release
from .attempts import attempt_abandon, attempt_finish, attempt_heartbeat, leases_expire, reconcile
from .chaining import Finished, attempt_finish_and_claim
from .claiming import claim_round, jobs_claim, requirement_cache
from .common import hash_token
from .credentials import credential_issue, credential_used, credentials_revoke, worker_enroll, worker_reregister
from .jobs import job_cancel, job_enqueue, job_enqueue_in, job_retry, jobs_enqueue_in
from .logs import log_append, logs_prune
from .records import attempt_heartbeat_with_checkpoint, job_record, job_records, record_of_job, records_of_job
from .workers import worker_drain, worker_forget, worker_heartbeat, worker_register, worker_undrain, workers_forget

__all__ = [
    "Finished",
    "attempt_abandon",
    "affinity_release",
    "attempt_finish",
    "attempt_finish_and_claim",
    "attempt_heartbeat",
    "attempt_heartbeat_with_checkpoint",
    "claim_round",
    "credential_issue",
    "credential_used",
    "credentials_revoke",
    "hash_token",
    "job_cancel",
    "job_enqueue",
    "job_enqueue_in",
    "job_record",
    "job_retry",
    "job_records",
    "jobs_claim",
    "jobs_enqueue_in",
    "leases_expire",
    "log_append",
    "logs_prune",
    "reconcile",
    "record_of_job",
    "records_of_job",
    "requirement_cache",
    "worker_drain",
    "worker_enroll",
    "worker_forget",
    "worker_heartbeat",
    "worker_register",
    "worker_reregister",
    "worker_undrain",
    "workers_forget",
]
