"""The one place where errors become HTTP answers (PROTOCOL.md "Errors").

Every error leaves as `{"error": {"code", "message", "details"}}` with the
documented status. Domain errors of jobqueue.exceptions keep their code;
DRF's and Django's exceptions are mapped onto the protocol's codes. Messages
never contain a token: services do not put one in theirs, authentication
failures say only that the token was missing or wrong, and database errors
(whose text can name hosts and users) are logged here, not echoed.
"""

import logging

from django.core.exceptions import RequestDataTooBig
from django.db import DatabaseError, InterfaceError, OperationalError
from django.http import Http404
from rest_framework import exceptions as drf
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import set_rollback

from jobqueue import exceptions as domain

from .auth import AUTHENTICATE
from .throttle import retry_after_header

log = logging.getLogger("apiary.api")

# Domain error code → HTTP status; codes pass through unchanged.
DOMAIN_STATUS = {
    domain.InvalidRequest.code: status.HTTP_400_BAD_REQUEST,
    domain.NotFound.code: status.HTTP_404_NOT_FOUND,
    domain.StaleAttempt.code: status.HTTP_409_CONFLICT,
    domain.SessionSuperseded.code: status.HTTP_409_CONFLICT,
    domain.Unavailable.code: status.HTTP_503_SERVICE_UNAVAILABLE,
    **{error.code: status.HTTP_403_FORBIDDEN for error in domain.Forbidden.__subclasses__()},
}

# Every code the protocol answers with (the OpenAPI document lists them).
CODES = (
    "invalid_request",
    "unauthorized",
    *(error.code for error in domain.Forbidden.__subclasses__()),
    "not_found",
    "unsupported_protocol",
    "method_not_allowed",
    "stale_attempt",
    "session_superseded",
    "payload_too_large",
    "rate_limited",
    "unavailable",
    "internal_error",
)

RETRY_AFTER = "1"  # seconds; clients add their own jittered backoff


class PayloadTooLarge(drf.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "payload_too_large"

    def __init__(self, *, limit: int):
        super().__init__(f"the request body is larger than the limit of {limit} bytes")
        self.limit = limit


class UnsupportedProtocol(drf.APIException):
    status_code = status.HTTP_404_NOT_FOUND
    default_code = "unsupported_protocol"


def error_body(code: str, message: str, details: dict | None = None) -> dict:
    return {"error": {"code": code, "message": message, "details": details or {}}}


def _field_details(detail) -> dict:
    """DRF's nested ValidationError detail → {field: [messages]}; errors that
    belong to no field go under `non_field_errors`, as DRF names them."""
    if isinstance(detail, dict):
        return {str(name): _messages(value) for name, value in detail.items()}
    return {"non_field_errors": _messages(detail)}


def _messages(value) -> list:
    if isinstance(value, dict):  # a nested serializer: keep its structure
        return [_field_details(value)]
    if isinstance(value, list):
        flat = []
        for item in value:
            flat.extend(_messages(item) if isinstance(item, list | dict) else [str(item)])
        return flat
    return [str(value)]


def _validation(exc: drf.ValidationError) -> tuple[int, str, str, dict, dict]:
    details = _field_details(exc.detail)
    names = ", ".join(details)
    return 400, "invalid_request", f"invalid request: check {names}", details, {}


def classify(exc: Exception) -> tuple[int, str, str, dict, dict]:
    """(status, code, message, details, headers) for any exception."""
    if isinstance(exc, domain.Unavailable):
        log.warning("%s", exc.message)
        return 503, "unavailable", "the database is busy or down; retry with backoff", {}, {"Retry-After": RETRY_AFTER}
    if isinstance(exc, domain.RateLimited):
        return 429, exc.code, exc.message, {"retry_after": round(exc.retry_after, 3)}, {
            "Retry-After": retry_after_header(exc.retry_after)
        }
    if isinstance(exc, domain.QueueError) and exc.code in DOMAIN_STATUS:
        details = dict(exc.details)
        if isinstance(exc, domain.InvalidRequest) and "field" in details:
            details = {str(details.pop("field")): [exc.message], **details}
        return DOMAIN_STATUS[exc.code], exc.code, exc.message, details, {}
    if isinstance(exc, drf.ValidationError):
        return _validation(exc)
    if isinstance(exc, drf.ParseError):
        return 400, "invalid_request", str(exc.detail), {"body": [str(exc.detail)]}, {}
    if isinstance(exc, drf.UnsupportedMediaType):
        message = "the body must be JSON (Content-Type: application/json)"
        return 400, "invalid_request", message, {"Content-Type": [message]}, {}
    if isinstance(exc, drf.NotAuthenticated | drf.AuthenticationFailed):
        # exc.detail is our own wording (auth.py) or DRF's; neither holds the token.
        return 401, "unauthorized", str(exc.detail), {}, {"WWW-Authenticate": AUTHENTICATE}
    if isinstance(exc, PayloadTooLarge):
        return 413, "payload_too_large", str(exc.detail), {"limit": exc.limit}, {}
    if isinstance(exc, RequestDataTooBig):
        return 413, "payload_too_large", "the request body is larger than the limit", {}, {}
    if isinstance(exc, UnsupportedProtocol):
        return 404, "unsupported_protocol", str(exc.detail), {"supported": [1]}, {}
    if isinstance(exc, Http404 | drf.NotFound):
        return 404, "not_found", "no such resource in worker protocol 1", {}, {}
    if isinstance(exc, drf.MethodNotAllowed):
        return 405, "method_not_allowed", str(exc.detail), {}, {}
    if isinstance(exc, OperationalError | InterfaceError):
        log.warning("database unavailable: %s", exc)
        return 503, "unavailable", "the database is busy or down; retry with backoff", {}, {"Retry-After": RETRY_AFTER}
    if isinstance(exc, drf.APIException):  # not raised by this API today; keep DRF's status
        return exc.status_code, str(exc.default_code), str(exc.detail), {}, {}
    kind = "database error" if isinstance(exc, DatabaseError) else "unexpected error"
    log.error("worker protocol: %s", kind, exc_info=exc)
    return 500, "internal_error", "internal error; the control plane logged it", {}, {}


def exception_handler(exc: Exception, context: dict) -> Response:
    """DRF's EXCEPTION_HANDLER: every exception gets a JSON answer (never None,
    so DRF never falls back to Django's HTML error pages)."""
    status_code, code, message, details, headers = classify(exc)
    set_rollback()
    return Response(error_body(code, message, details), status=status_code, headers=headers)
