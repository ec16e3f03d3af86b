"""Request and response shapes of worker protocol 1 (PROTOCOL.md "Endpoints").

Request serializers are strict: JSON types are not coerced (`"5"` is not an
integer, `1` is not a boolean), unknown fields are refused by name, and every
string and number is bounded so nothing reaches the database that a column
would refuse (PostgreSQL enforces varchar lengths and integer ranges).
Response serializers shape the answers and describe them in the OpenAPI
document.
"""

from collections.abc import Mapping

from django.core.validators import RegexValidator
from rest_framework import serializers

from jobqueue.models import JobState
from jobqueue.types import (
    ENROLLMENT_KEY_PATTERN,
    LOG_STREAM_PATTERN,
    MAX_CAPABILITIES,
    MAX_CAPACITY,
    MAX_CHECKPOINT_BYTES,
    MAX_LABELS,
    MAX_LOG_CHUNK_BYTES,
    MAX_LOG_OFFSET,
    MAX_LOG_STREAM_BYTES,
    MAX_NAME_LENGTH,
    MAX_RECORD_KEY,
    MAX_RECORD_VALUE_BYTES,
    OUTCOMES,
    RECORD_STATES,
    WORKER_ID_PATTERN,
    Claim,
)

from .errors import CODES

MAX_INT = 2**31 - 1  # PostgreSQL `integer`
MAX_WAIT = 30.0


# --------------------------------------------------------------------------- strict fields


class StrictCharField(serializers.CharField):
    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictFloatField(serializers.FloatField):
    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        try:
            return super().to_internal_value(data)
        except OverflowError:  # an integer too large for a float; DRF lets it escape
            self.fail("invalid")


class StrictBooleanField(serializers.BooleanField):
    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not know, naming each of them."""

    def to_internal_value(self, data):
        unknown = {}
        if isinstance(data, Mapping):
            unknown = {str(name): ["unknown field"] for name in data if name not in self.fields}
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:  # report every problem at once
            if unknown and isinstance(exc.detail, dict):
                raise serializers.ValidationError({**exc.detail, **unknown}) from None
            raise
        if unknown:
            raise serializers.ValidationError(unknown)
        return value


def _worker_id() -> StrictCharField:
    return StrictCharField(
        max_length=128,
        trim_whitespace=False,
        validators=[RegexValidator(rf"^{WORKER_ID_PATTERN}\Z", message=f"must match {WORKER_ID_PATTERN}")],
    )


def _session() -> StrictCharField:
    # Sessions are opaque ASCII; the service compares them with hmac.compare_digest,
    # which refuses non-ASCII str, so anything else is a bad request here.
    return StrictCharField(
        max_length=128,
        trim_whitespace=False,
        validators=[RegexValidator(r"^[!-~]+\Z", message="must be printable ASCII without spaces")],
    )


def _names(most: int, **kwargs) -> serializers.ListField:
    """Labels and capabilities."""
    return serializers.ListField(
        child=StrictCharField(max_length=MAX_NAME_LENGTH, trim_whitespace=False), max_length=most, **kwargs
    )


# --------------------------------------------------------------------------- requests


class RegisterSerializer(StrictSerializer):
    """POST workers/register."""

    worker_id = _worker_id()
    pool = StrictCharField(max_length=MAX_NAME_LENGTH, allow_null=True, required=False, default=None)
    labels = _names(MAX_LABELS, required=False, default=list)
    capabilities = _names(MAX_CAPABILITIES, required=False, default=list)
    capacity = StrictIntegerField(min_value=1, max_value=MAX_CAPACITY)
    version = StrictCharField(max_length=64, allow_blank=True, required=False, default="")
    hostname = StrictCharField(max_length=255, allow_blank=True, required=False, default="")
    pid = StrictIntegerField(min_value=0, max_value=MAX_INT, allow_null=True, required=False, default=None)
    enrollment_key = StrictCharField(
        min_length=32,
        max_length=128,
        required=False,
        default="",
        trim_whitespace=False,
        validators=[RegexValidator(rf"^{ENROLLMENT_KEY_PATTERN}\Z", message="must be 32–128 URL-safe characters")],
        help_text="with the shared token: a random value the worker keeps until it has its credential; "
        "the same enrolment sent again with it, after a lost answer, is answered again",
    )


class WorkerHeartbeatSerializer(StrictSerializer):
    """POST workers/{worker_id}/heartbeat."""

    session = _session()
    draining = StrictBooleanField(required=False, default=False)
    ready = StrictBooleanField(required=False, default=True)


class ClaimSerializer(StrictSerializer):
    """POST claims. `wait` > 0 long-polls up to that many seconds."""

    worker_id = _worker_id()
    session = _session()
    max_jobs = StrictIntegerField(min_value=1, max_value=MAX_INT, required=False, default=1)
    wait = StrictFloatField(min_value=0, max_value=MAX_WAIT, required=False, default=0)


def _utf8_at_most(limit: int):
    def check(value: str) -> None:
        if len(value.encode("utf-8", "surrogatepass")) > limit:
            raise serializers.ValidationError(f"must be at most {limit} bytes of UTF-8")

    return check


class CheckpointSerializer(StrictSerializer):
    """A step's checkpoint, sent with an attempt heartbeat."""

    step = StrictCharField(
        max_length=MAX_NAME_LENGTH,
        trim_whitespace=False,
        validators=[RegexValidator(rf"^{WORKER_ID_PATTERN}\Z", message=f"must be a step id ({WORKER_ID_PATTERN})")],
    )
    content = StrictCharField(
        allow_blank=True, trim_whitespace=False, validators=[_utf8_at_most(MAX_CHECKPOINT_BYTES)],
        help_text=f"the step's checkpoint file, at most {MAX_CHECKPOINT_BYTES} bytes of UTF-8",
    )  # fmt: skip


class AttemptHeartbeatSerializer(StrictSerializer):
    """POST attempts/{attempt_id}/heartbeat."""

    # Any string: a token that is not this attempt's is answered 409 stale_attempt.
    token = StrictCharField(max_length=256, trim_whitespace=False)
    checkpoint = CheckpointSerializer(
        required=False, allow_null=True, default=None,
        help_text="the latest content of a step's checkpoint: kept as the record `checkpoint:<step>` (state "
        "`started`, value {\"content\": …}) in the heartbeat's transaction",
    )  # fmt: skip


class RecordSerializer(StrictSerializer):
    """POST attempts/{attempt_id}/records."""

    token = StrictCharField(max_length=256, trim_whitespace=False)
    key = StrictCharField(max_length=MAX_RECORD_KEY, trim_whitespace=False)
    state = serializers.ChoiceField(
        choices=RECORD_STATES, error_messages={"invalid_choice": f"must be one of {', '.join(RECORD_STATES)}"}
    )
    value = serializers.DictField(
        required=False, default=dict, help_text=f"any JSON object, at most {MAX_RECORD_VALUE_BYTES} bytes as JSON"
    )


class RecordsSerializer(StrictSerializer):
    """POST attempts/{attempt_id}/records/list."""

    token = StrictCharField(max_length=256, trim_whitespace=False)


class LogAppendSerializer(StrictSerializer):
    """POST attempts/{attempt_id}/logs."""

    token = StrictCharField(max_length=256, trim_whitespace=False)
    stream = StrictCharField(
        max_length=255, trim_whitespace=False,
        validators=[RegexValidator(rf"^{LOG_STREAM_PATTERN}\Z", message=f"must match {LOG_STREAM_PATTERN}")],
        help_text="the stream's name (Apiary's workflows: the step's history id, e.g. `plan`, `hook:failed:notify`)",
    )  # fmt: skip
    offset = StrictIntegerField(
        min_value=0, max_value=MAX_LOG_OFFSET,
        help_text="where this text starts, in bytes of UTF-8 from the stream's start",
    )  # fmt: skip
    text = StrictCharField(
        allow_blank=True, trim_whitespace=False, validators=[_utf8_at_most(MAX_LOG_CHUNK_BYTES)],
        help_text=f"at most {MAX_LOG_CHUNK_BYTES} bytes of UTF-8, no NUL",
    )  # fmt: skip
    final = StrictBooleanField(required=False, default=False, help_text="the stream's last chunk: it ends here")


class FinishSerializer(StrictSerializer):
    """POST attempts/{attempt_id}/finish."""

    token = StrictCharField(max_length=256, trim_whitespace=False)
    outcome = serializers.ChoiceField(
        choices=OUTCOMES, error_messages={"invalid_choice": f"must be one of {', '.join(OUTCOMES)}"}
    )
    summary = serializers.DictField(required=False, default=dict)
    error = StrictCharField(allow_null=True, allow_blank=True, trim_whitespace=False, required=False, default=None)


# --------------------------------------------------------------------------- responses


class WorkerView(serializers.Serializer):
    worker_id = serializers.CharField()
    pool = serializers.CharField(allow_null=True)
    labels = serializers.ListField(child=serializers.CharField())
    capabilities = serializers.ListField(child=serializers.CharField())
    capacity = serializers.IntegerField()
    draining = serializers.BooleanField()
    ready = serializers.BooleanField()
    drain_requested = serializers.BooleanField()
    version = serializers.CharField(allow_blank=True)
    hostname = serializers.CharField(allow_blank=True)
    pid = serializers.IntegerField(allow_null=True)
    registered_at = serializers.DateTimeField()
    last_heartbeat_at = serializers.DateTimeField()


class RegisterResponse(serializers.Serializer):
    credential = serializers.CharField(
        allow_null=True,
        help_text="the worker's own credential, shown this once, when the shared token enrolled it; "
        "null when the worker registered with its credential. Use it as the Bearer token of every later call.",
    )
    session = serializers.CharField()
    protocol = serializers.ChoiceField(choices=[1])
    lease_duration = serializers.FloatField()
    heartbeat_interval = serializers.FloatField()
    worker_timeout = serializers.FloatField()
    features = serializers.ListField(
        child=serializers.CharField(),
        help_text="additions to protocol 1 this control plane serves: `journal` (attempts/{id}/records, "
        "records/list, the heartbeat's checkpoint), `logs` (attempts/{id}/logs); absent on a control plane "
        "from before them",
    )
    worker = WorkerView()


class WorkerHeartbeatResponse(serializers.Serializer):
    drain = serializers.BooleanField()


class TaskView(serializers.Serializer):
    id = serializers.IntegerField()
    source = serializers.CharField()
    item_key = serializers.CharField()
    generation = serializers.IntegerField()
    title = serializers.CharField(allow_blank=True)
    body = serializers.CharField(allow_blank=True)
    payload = serializers.JSONField()


class ClaimedJob(serializers.Serializer):
    """The queue's own fields of a claimed job (jobqueue.types.CLAIM_FIELDS)."""

    job_id = serializers.IntegerField()
    attempt_id = serializers.IntegerField()
    attempt_number = serializers.IntegerField()
    token = serializers.CharField()
    lease_expires_at = serializers.DateTimeField()
    agent = serializers.CharField()
    runner = serializers.CharField()


class JobView(ClaimedJob):
    """A claimed job on the wire: the queue's fields and, beside them, the
    keys of the job's payload. The queue never reads the payload; Apiary's
    workflows write these three keys into it (documented here for the schema)."""

    workflow = serializers.CharField()
    instance_id = serializers.IntegerField()
    task = TaskView()


def claimed_job(claim: Claim) -> dict:
    """A claim as protocol v1 sends it: payload keys beside the queue's own
    (enqueue refuses a payload that uses a queue field's name)."""
    return {**claim.payload, **ClaimedJob(claim).data}


class ClaimResponse(serializers.Serializer):
    jobs = JobView(many=True)


class AttemptHeartbeatResponse(serializers.Serializer):
    lease_expires_at = serializers.DateTimeField()
    cancel = serializers.BooleanField()


class RecordView(serializers.Serializer):
    """A record of the job's journal (jobqueue/services/records.py says the rules)."""

    key = serializers.CharField()
    state = serializers.ChoiceField(choices=RECORD_STATES)
    value = serializers.DictField()
    attempt_number = serializers.IntegerField(help_text="the attempt that wrote it (last)")
    started_by = serializers.IntegerField(allow_null=True, help_text="the attempt that recorded `started`")
    started_earlier = serializers.BooleanField(
        help_text="an attempt before `attempt_number` started it, and its end is unknown unless the state is `done`"
    )
    already_done = serializers.BooleanField(help_text="this write found the record `done` and changed nothing")


class RecordResponse(serializers.Serializer):
    record = RecordView()


class RecordsResponse(serializers.Serializer):
    records = RecordView(many=True)


class LogAppendResponse(serializers.Serializer):
    stream = serializers.CharField()
    received = serializers.IntegerField(help_text="bytes of the stream received: the next chunk's offset")
    dropped = serializers.IntegerField(
        help_text=f"bytes at the stream's start no longer kept (the control plane keeps its last {MAX_LOG_STREAM_BYTES})"
    )
    ended = serializers.BooleanField(help_text="the stream's last chunk came")
    stored = serializers.BooleanField(help_text="this chunk added text (false for a resend of text already received)")


class FinishResponse(serializers.Serializer):
    job_state = serializers.ChoiceField(
        choices=[JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED]
    )


class JobCounts(serializers.Serializer):
    queued = serializers.IntegerField()
    leased = serializers.IntegerField()
    succeeded = serializers.IntegerField()
    failed = serializers.IntegerField()
    cancelled = serializers.IntegerField()


class StatusWorker(serializers.Serializer):
    worker_id = serializers.CharField()
    pool = serializers.CharField(allow_null=True)
    labels = serializers.ListField(child=serializers.CharField())
    capabilities = serializers.ListField(child=serializers.CharField())
    capacity = serializers.IntegerField()
    active_jobs = serializers.IntegerField()
    health = serializers.ChoiceField(choices=["healthy", "stale", "exited"])
    draining = serializers.BooleanField()
    ready = serializers.BooleanField()
    last_heartbeat_at = serializers.DateTimeField()


class StatusActive(serializers.Serializer):
    job_id = serializers.IntegerField()
    # From the job's payload (jobqueue.selectors.payload_refs); null when it has no such key.
    instance_id = serializers.IntegerField(allow_null=True)
    task_id = serializers.IntegerField(allow_null=True)
    workflow = serializers.CharField(allow_null=True)
    # The instance whose spawn step created this job's task (issue 10); null for any other.
    parent_instance_id = serializers.IntegerField(allow_null=True)
    hook = serializers.ChoiceField(choices=OUTCOMES, allow_null=True, help_text="the outcome whose hook this job runs")
    worker_id = serializers.CharField()
    attempt_number = serializers.IntegerField()
    lease_expires_at = serializers.DateTimeField()
    cancel_requested = serializers.BooleanField()


class StatusBlocked(serializers.Serializer):
    job_id = serializers.IntegerField()
    reason = serializers.CharField()


class StatusResponse(serializers.Serializer):
    jobs = JobCounts()
    workers = StatusWorker(many=True)
    active = StatusActive(many=True)
    blocked = StatusBlocked(many=True)


class ErrorDetail(serializers.Serializer):
    code = serializers.ChoiceField(choices=CODES)
    message = serializers.CharField()
    details = serializers.DictField()


class ErrorResponse(serializers.Serializer):
    error = ErrorDetail()
