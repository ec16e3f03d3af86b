"""The protocol's read of an instance's step logs (PROTOCOL.md "GET instances/{id}/logs"):
views on the worker protocol's own base (its authentication, errors and
`Apiary-Protocol` header), authorised like `GET status`: any worker
credential or the shared token. The queue keeps opaque log streams; what
an instance's logs are is this layer's (workflows/logs.py), so the views
live here and apiary_site routes them under /api/worker/v1/."""

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from jobqueue.api.schema import AUTHENTICATE_HEADER, PROTOCOL_HEADER, responses
from jobqueue.api.views import ProtocolView
from jobqueue.exceptions import OperatorTokenRequired
from jobqueue.models import AttemptState, JobState
from jobqueue.types import LOG_STREAM_PATTERN, OUTCOMES

from . import logs

INSTANCE_ID = OpenApiParameter("instance_id", str, OpenApiParameter.PATH, pattern=r"^[0-9]{1,18}$")
ATTEMPT_NUMBER = OpenApiParameter("attempt_number", str, OpenApiParameter.PATH, pattern=r"^[0-9]{1,9}$")
STEP = OpenApiParameter("step", str, OpenApiParameter.PATH, pattern=rf"^{LOG_STREAM_PATTERN}$")
OFFSET = OpenApiParameter(
    "offset", str, OpenApiParameter.PATH, pattern=r"^[0-9]{1,19}$", description="bytes of UTF-8 from the log's start"
)
UNKNOWN = "`not_found`: no such instance, or no log of that step in that attempt"


class StepLogView(serializers.Serializer):
    step = serializers.CharField(help_text="the step's history id (`hook:<outcome>:<step>` for a hook job's step)")
    job_id = serializers.IntegerField()
    hook = serializers.ChoiceField(choices=OUTCOMES, allow_null=True, help_text="the outcome of the hook job that ran it")
    attempt_number = serializers.IntegerField()
    attempt_state = serializers.ChoiceField(choices=AttemptState.values)
    worker_id = serializers.CharField(allow_blank=True)
    received = serializers.IntegerField(help_text="bytes of the log the control plane received")
    dropped = serializers.IntegerField(help_text="bytes at its start no longer kept (it keeps the last MiB)")
    ended = serializers.BooleanField(help_text="the step ended and its log is complete")
    started_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class InstanceLogsResponse(serializers.Serializer):
    instance_id = serializers.IntegerField()
    workflow = serializers.CharField()
    job_id = serializers.IntegerField(allow_null=True)
    state = serializers.ChoiceField(choices=JobState.values, allow_null=True, help_text="the instance's job's state")
    attempt_number = serializers.IntegerField(allow_null=True, help_text="its job's latest attempt")
    steps = StepLogView(many=True)


class StepLogTextResponse(serializers.Serializer):
    step = serializers.CharField()
    attempt_number = serializers.IntegerField()
    attempt_state = serializers.ChoiceField(choices=AttemptState.values)
    offset = serializers.IntegerField(help_text="where `text` starts: the offset asked for, or the first byte kept")
    text = serializers.CharField(allow_blank=True, help_text="at most 256 KiB; ask again from `next_offset` for more")
    next_offset = serializers.IntegerField()
    received = serializers.IntegerField()
    dropped = serializers.IntegerField()
    ended = serializers.BooleanField()


def _schema(operation_id: str, ok, description: str, parameters: list):
    return extend_schema(
        operation_id=operation_id,
        request=None,
        responses=responses(
            ok, description, body=False, not_found=UNKNOWN,
            forbidden="a worker's own credential (`operator_token_required`): step logs are read with the shared token",
        ),  # fmt: skip
        parameters=[*parameters, PROTOCOL_HEADER, AUTHENTICATE_HEADER],
    )


def _operator_only(request) -> None:
    """Step logs hold what steps print; a step can read its worker's credential file, so only the
    shared token (an operator's, or a worker's before it enrolled) reads them, never a credential."""
    if request.user.worker_id is not None:
        raise OperatorTokenRequired(
            f"step logs are read with the shared worker token, not worker {request.user.worker_id!r}'s own credential"
        )


class InstanceLogsView(ProtocolView):
    @_schema("instances_logs_list", InstanceLogsResponse, "every step log of the instance and its hook jobs", [INSTANCE_ID])
    def get(self, request, instance_id: str):
        _operator_only(request)
        return Response(InstanceLogsResponse(logs.instance_logs(instance_id=int(instance_id))).data)


class InstanceLogTextView(ProtocolView):
    @_schema(
        "instances_logs_read", StepLogTextResponse, "the step's log from `offset`",
        [INSTANCE_ID, ATTEMPT_NUMBER, STEP, OFFSET],
    )  # fmt: skip
    def get(self, request, instance_id: str, attempt_number: str, step: str, offset: str):
        _operator_only(request)
        document = logs.instance_log_text(
            instance_id=int(instance_id), attempt_number=int(attempt_number), step=step, offset=int(offset)
        )
        return Response(StepLogTextResponse(document).data)
