"""Worker protocol 1 endpoints: validate, call one service or selector, shape the answer.

Every view reads its body through `buffer_body` (hard cap, after
authentication, so an unauthenticated client cannot make us buffer
anything), answers JSON only, and stamps `Apiary-Protocol: 1` on whatever it
returns, errors included. State changes happen only inside the services, one
short transaction each; an error anywhere before or inside them changes nothing.
"""

from django.http import QueryDict
from drf_spectacular.renderers import OpenApiJsonRenderer2
from drf_spectacular.utils import OpenApiParameter, extend_schema
from drf_spectacular.views import SpectacularAPIView
from rest_framework.exceptions import NotFound
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.permissions import SAFE_METHODS, IsAuthenticated
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from jobqueue import conf, selectors, services
from jobqueue.longpoll import claim_with_wait
from jobqueue.services.identity import LEGACY, acting_as

from . import serializers as s
from .auth import WorkerTokenAuthentication
from .errors import UnsupportedProtocol
from .parsers import ProtocolJSONParser, buffer_body
from .schema import AUTHENTICATE_HEADER, PROTOCOL_HEADER, responses
from .throttle import claims as claim_budget

PROTOCOL_VERSION = 1
# What this control plane offers beyond protocol 1's first version; a worker uses only what is listed
# (a control plane from before them lists nothing, and its worker then runs no publish or spawn step).
FEATURES = ("journal", "logs")
DEFER_CLAIM = "apiary.defer_claim"  # request.META flag: ClaimView validates, returns a Deferred


class JSONOnly(DefaultContentNegotiation):
    """The protocol speaks JSON whatever the client's Accept says: no 406."""

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class ProtocolMixin:
    parser_classes = [ProtocolJSONParser]
    renderer_classes = [JSONRenderer]
    content_negotiation_class = JSONOnly
    authentication_classes = [WorkerTokenAuthentication]
    permission_classes = [IsAuthenticated]
    metadata_class = None  # no OPTIONS introspection: 405

    def initialize_request(self, request, *args, **kwargs):
        # The protocol has no query parameters. Drop whatever came, so a token a
        # client wrongly put in the URL is not kept on the request (Django's
        # request logging and error reports show the full path).
        request.META["QUERY_STRING"] = ""
        request.GET = QueryDict()
        return super().initialize_request(request, *args, **kwargs)

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)  # content negotiation, authentication, permissions
        if request.method not in SAFE_METHODS:
            buffer_body(request._request)

    def finalize_response(self, request, response, *args, **kwargs):
        response = super().finalize_response(request, response, *args, **kwargs)
        response["Apiary-Protocol"] = str(PROTOCOL_VERSION)
        return response


class ProtocolView(ProtocolMixin, APIView):
    def validated(self, serializer_class, request) -> dict:
        serializer = serializer_class(data=request.data)
        serializer.is_valid(raise_exception=True)
        return serializer.validated_data


def principal_id(request) -> str:
    """Who the request acts as: its credential's worker id, or LEGACY for the
    shared token (services/identity.py says for which ids that still counts)."""
    return request.user.worker_id or LEGACY


def as_worker(request, worker_id: str) -> None:
    """The call names `worker_id`: the request's credential must be that worker's."""
    acting_as(worker_id, principal_id(request))


def _schema(operation_id: str, request, ok, description: str, **errors):
    return extend_schema(
        operation_id=operation_id,
        request=request,
        responses=responses(ok, description, body=request is not None, **errors),
        parameters=[PROTOCOL_HEADER, AUTHENTICATE_HEADER],
    )


UNKNOWN_WORKER = "`not_found`: the worker id is not registered"
FORBIDDEN = (
    "`worker_mismatch`: the credential is another worker's; `credential_required`: the shared token "
    "cannot act as a worker"
)
REGISTER_FORBIDDEN = (
    "`reserved_worker_id`, `enrollment_closed`, `credential_required` (the id is enrolled or held by a live "
    "process: register with its credential), `credential_revoked`, `worker_mismatch`"
)
RATE_LIMITED = "`rate_limited`: over the worker's claim budget; `Retry-After` says when to try again"
UNKNOWN_ATTEMPT = "`not_found`: no such attempt"
SUPERSEDED = "`session_superseded`: the worker id was registered again by a newer process"
STALE = (
    "`stale_attempt`: the token does not match, the attempt is not the job's current one, "
    "its lease expired, or it finished with another outcome"
)
WORKER_ID = OpenApiParameter("worker_id", str, OpenApiParameter.PATH, pattern=rf"^{s.WORKER_ID_PATTERN}$")
ATTEMPT_ID = OpenApiParameter("attempt_id", str, OpenApiParameter.PATH, pattern=r"^[0-9]{1,18}$")


class RegisterView(ProtocolView):
    @_schema(
        "workers_register",
        s.RegisterSerializer,
        s.RegisterResponse,
        "a new session for the worker id; `credential` is its new credential when the shared token enrolled it",
        forbidden=REGISTER_FORBIDDEN,
    )
    def post(self, request):
        registration = self.validated(s.RegisterSerializer, request)
        key = registration.pop("enrollment_key")
        credential = None
        if request.user.worker_id is None:  # the shared token: enrolment of a new id
            worker, credential = services.worker_enroll(enrollment_key=key, **registration)
        else:
            worker = services.worker_reregister(
                acting_as=request.user.worker_id, credential_id=request.user.credential_id, **registration
            )
        cfg = conf.current()
        answer = {
            "credential": credential,
            "session": worker.session,
            "protocol": PROTOCOL_VERSION,
            "lease_duration": cfg.lease_duration,
            "heartbeat_interval": cfg.heartbeat_interval,
            "worker_timeout": cfg.worker_timeout,
            "features": list(FEATURES),
            "worker": worker,
        }
        return Response(s.RegisterResponse(answer).data)


class WorkerHeartbeatView(ProtocolView):
    @extend_schema(parameters=[WORKER_ID])
    @_schema(
        "workers_heartbeat",
        s.WorkerHeartbeatSerializer,
        s.WorkerHeartbeatResponse,
        "`drain: true` when an operator asked this worker to drain",
        not_found=UNKNOWN_WORKER,
        conflict=SUPERSEDED,
        forbidden=FORBIDDEN,
    )
    def post(self, request, worker_id: str):
        as_worker(request, worker_id)
        data = self.validated(s.WorkerHeartbeatSerializer, request)
        worker = services.worker_heartbeat(worker_id=worker_id, **data)
        return Response(s.WorkerHeartbeatResponse({"drain": worker.drain_requested}).data)


class ClaimView(ProtocolView):
    @_schema(
        "claims_create",
        s.ClaimSerializer,
        s.ClaimResponse,
        "leased jobs, possibly none; never beyond the worker's free capacity",
        not_found=UNKNOWN_WORKER,
        conflict=SUPERSEDED,
        forbidden=FORBIDDEN,
        rate_limited=RATE_LIMITED,
    )
    def post(self, request):
        arguments = self.validated(s.ClaimSerializer, request)
        as_worker(request, arguments["worker_id"])
        claim_budget.charge(arguments["worker_id"])
        if request.META.get(DEFER_CLAIM):  # the ASGI endpoint long-polls itself (api/asgi.py)
            return Deferred(arguments)
        claims = claim_with_wait(**arguments)
        return Response({"jobs": [s.claimed_job(claim) for claim in claims]})


class Deferred(Response):
    """A validated claim, for the ASGI endpoint to long-poll and answer."""

    def __init__(self, arguments: dict):
        super().__init__(None, status=202)
        self.arguments = arguments


class AttemptHeartbeatView(ProtocolView):
    @extend_schema(parameters=[ATTEMPT_ID])
    @_schema(
        "attempts_heartbeat",
        s.AttemptHeartbeatSerializer,
        s.AttemptHeartbeatResponse,
        "the lease is extended; `cancel: true` means stop the runner and finish `cancelled`",
        not_found=UNKNOWN_ATTEMPT,
        conflict=STALE,
        forbidden=FORBIDDEN,
    )
    def post(self, request, attempt_id: str):
        data = self.validated(s.AttemptHeartbeatSerializer, request)
        checkpoint, who = data.pop("checkpoint"), principal_id(request)
        if checkpoint is None:
            beat = services.attempt_heartbeat(attempt_id=int(attempt_id), acting_as=who, **data)
        else:
            beat = services.attempt_heartbeat_with_checkpoint(attempt_id=int(attempt_id), acting_as=who, **data, **checkpoint)
        return Response(s.AttemptHeartbeatResponse(beat).data)


class FinishView(ProtocolView):
    @extend_schema(parameters=[ATTEMPT_ID])
    @_schema(
        "attempts_finish",
        s.FinishSerializer,
        s.FinishResponse,
        "the job's resulting state; the same finish again gets the same answer",
        not_found=UNKNOWN_ATTEMPT,
        conflict=STALE,
        forbidden=FORBIDDEN,
    )
    def post(self, request, attempt_id: str):
        data = self.validated(s.FinishSerializer, request)
        job_state = services.attempt_finish(attempt_id=int(attempt_id), acting_as=principal_id(request), **data)
        return Response(s.FinishResponse({"job_state": job_state}).data)


class AttemptRecordView(ProtocolView):
    @extend_schema(parameters=[ATTEMPT_ID])
    @_schema(
        "attempts_record",
        s.RecordSerializer,
        s.RecordResponse,
        "the record as it now is: `started` over `started` says whether an earlier attempt started it "
        "(`started_earlier`); a `done` record is final, and writing over it answers it unchanged (`already_done`)",
        not_found=UNKNOWN_ATTEMPT,
        conflict=STALE,
        forbidden=FORBIDDEN,
    )
    def post(self, request, attempt_id: str):
        data = self.validated(s.RecordSerializer, request)
        record = services.job_record(attempt_id=int(attempt_id), acting_as=principal_id(request), **data)
        return Response(s.RecordResponse({"record": record}).data)


class AttemptRecordsView(ProtocolView):
    @extend_schema(parameters=[ATTEMPT_ID])
    @_schema(
        "attempts_records_list",
        s.RecordsSerializer,
        s.RecordsResponse,
        "every record of the attempt's job, oldest first, whichever of its attempts wrote them",
        not_found=UNKNOWN_ATTEMPT,
        conflict=STALE,
        forbidden=FORBIDDEN,
    )
    def post(self, request, attempt_id: str):
        data = self.validated(s.RecordsSerializer, request)
        records = services.job_records(attempt_id=int(attempt_id), acting_as=principal_id(request), **data)
        return Response(s.RecordsResponse({"records": records}).data)


class AttemptLogView(ProtocolView):
    @extend_schema(parameters=[ATTEMPT_ID])
    @_schema(
        "attempts_logs_append",
        s.LogAppendSerializer,
        s.LogAppendResponse,
        "the stream after this chunk: appended at `offset`, or nothing stored for a resend of text already "
        "received (`stored: false`); the stream keeps its last MiB (`dropped` counts what came before)",
        not_found=UNKNOWN_ATTEMPT,
        conflict=STALE,
        forbidden=FORBIDDEN,
    )
    def post(self, request, attempt_id: str):
        data = self.validated(s.LogAppendSerializer, request)
        state = services.log_append(attempt_id=int(attempt_id), acting_as=principal_id(request), **data)
        return Response(s.LogAppendResponse(state).data)


class StatusView(ProtocolView):
    @_schema("status_retrieve", None, s.StatusResponse, "job counts, workers, active and blocked jobs")
    def get(self, request):
        return Response(selectors.status_document())


class SchemaView(ProtocolMixin, SpectacularAPIView):
    """The OpenAPI 3 document of this protocol (JSON)."""

    renderer_classes = [OpenApiJsonRenderer2]


class UnknownPathView(ProtocolView):
    """Everything under /api/worker/ that no endpoint matches, answered in
    JSON rather than Django's HTML 404. No token needed: the answer reveals
    nothing, and a worker on a retired version must learn why it is refused."""

    authentication_classes = []
    permission_classes = []
    schema = None  # not part of the OpenAPI document

    def initial(self, request, *args, **kwargs):
        APIView.initial(self, request, *args, **kwargs)  # negotiation only; the body is never read
        raise self.error(request)

    def error(self, request) -> Exception:
        return NotFound()


class UnsupportedProtocolView(UnknownPathView):
    def error(self, request) -> Exception:
        version = request.path.removeprefix("/api/worker").strip("/").split("/", 1)[0]
        if version == f"v{PROTOCOL_VERSION}":  # /api/worker/v1 without the slash
            return NotFound()
        return UnsupportedProtocol(
            f"unsupported protocol version: this control plane speaks worker protocol {PROTOCOL_VERSION}"
            f" only, under /api/worker/v{PROTOCOL_VERSION}/"
        )
