"""OpenAPI pieces drf-spectacular cannot infer: the Bearer scheme of
WorkerTokenAuthentication and the headers every response carries."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse

from .serializers import ErrorResponse


class WorkerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "jobqueue.api.auth.WorkerTokenAuthentication"
    name = "workerToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": (
                "a worker's own credential (`apw_…`, acting as its worker id), or the control plane's shared "
                "worker_token, which only registers new workers and reads status and step logs"
            ),
        }


PROTOCOL_HEADER = OpenApiParameter(
    "Apiary-Protocol",
    str,
    OpenApiParameter.HEADER,
    required=True,
    enum=["1"],
    description="the protocol version; on every response",
    response=True,
)

AUTHENTICATE_HEADER = OpenApiParameter(
    "WWW-Authenticate",
    str,
    OpenApiParameter.HEADER,
    required=True,
    description="Bearer challenge",
    response=[401],
)


def _error(text: str) -> OpenApiResponse:
    return OpenApiResponse(ErrorResponse, description=text)


def responses(
    ok,
    description: str,
    *,
    not_found: str = "",
    conflict: str = "",
    forbidden: str = "",
    rate_limited: str = "",
    body: bool = True,
) -> dict:
    """The 200 answer plus every error the endpoint can give (PROTOCOL.md "Errors")."""
    answers = {
        200: OpenApiResponse(ok, description=description),
        401: _error("`unauthorized`: missing, malformed or wrong worker token, or an unknown or revoked credential"),
        404: _error(not_found or "`not_found` / `unsupported_protocol`: no such path in protocol 1"),
        503: _error("`unavailable`: the database is busy or down; retry with backoff"),
    }
    if body:
        answers[400] = _error("`invalid_request`: malformed JSON, wrong types, missing, unknown or out-of-range fields")
        answers[413] = _error("`payload_too_large`: the body is over the limit (1 MiB)")
    if conflict:
        answers[409] = _error(conflict)
    if forbidden:
        answers[403] = _error(forbidden)
    if rate_limited:
        answers[429] = _error(rate_limited)
    return answers


def close_request_objects(result, generator, request, public):
    """drf-spectacular postprocessing hook: request bodies refuse unknown
    fields (StrictSerializer), so their schemas say `additionalProperties: false`."""
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if name.endswith("Request") and component.get("type") == "object":
            component["additionalProperties"] = False
    return result
