"""Reading and parsing request bodies with hard limits.

The body is read by counting the bytes that actually arrive, never by
believing Content-Length; the JSON is parsed so that every malformed or
hostile document (garbage, 100,000 levels of nesting, a 5,000-digit number,
NaN, a lone surrogate, a NUL) becomes a `ParseError` (400), never a 500 and
never a value the database or the JSON renderer would choke on later.
"""

import io
import json

from django.conf import settings
from django.http import HttpRequest
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser

# Shared with the workflow payload and the worker's claim check.
from jobqueue.jsonlimits import MAX_DEPTH, finite_float, reject_constant

from .errors import PayloadTooLarge

_CHUNK = 64 * 1024


def body_limit() -> int:
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 1024 * 1024


def _declared_length(request: HttpRequest) -> int | None:
    try:
        length = int(request.META.get("CONTENT_LENGTH") or "")
    except ValueError:
        return None
    return length if length >= 0 else None


def buffer_body(request: HttpRequest) -> bytes:
    """Read the body of `request` into memory, at most `body_limit()` bytes,
    and make it what Django and DRF will parse. Raises PayloadTooLarge.

    Where the server delimits the body itself (`wsgi.input_terminated`, set by
    gunicorn: Content-Length or chunked), the raw input is read to its end, so
    a missing or understated Content-Length cannot smuggle a larger body past
    the cap. Elsewhere PEP 3333 forbids reading past Content-Length (it could
    block), so Django's stream bounded by it is read — still counting bytes.
    Under ASGI (api/asgi.py) the server delimits the body and the request's
    stream is all of it, already cut one byte past the cap.
    """
    if hasattr(request, "_body"):  # already buffered (e.g. by a middleware)
        return request._body
    limit = body_limit()
    declared = _declared_length(request)
    if declared is not None and declared > limit:
        raise PayloadTooLarge(limit=limit)
    environ = getattr(request, "environ", {})  # an ASGIRequest has none
    source = environ["wsgi.input"] if environ.get("wsgi.input_terminated") else request
    chunks, total = [], 0
    while True:
        chunk = source.read(min(_CHUNK, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(limit=limit)
    body = b"".join(chunks)
    # Exactly what HttpRequest.body does after its own read; DRF then parses
    # these bytes, with the length we counted rather than the one declared.
    request._body = body
    request._stream = io.BytesIO(body)
    request._read_started = False
    request.META["CONTENT_LENGTH"] = str(len(body))
    return body


def _check_tree(document) -> None:
    """Depth and string checks, iteratively (the document may be hostile)."""
    stack = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = [*value.keys(), *value.values()]
        elif isinstance(value, list):
            children = value
        elif isinstance(value, str):
            _check_string(value)
            continue
        else:
            continue
        if depth > MAX_DEPTH:
            raise ParseError(f"JSON nested deeper than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)


def _check_string(value: str) -> None:
    if "\x00" in value:
        raise ParseError("JSON strings must not contain NUL (\\u0000)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ParseError("JSON strings must not contain lone surrogates (\\ud800-\\udfff)") from None


def loads(raw: bytes):
    """Parse a protocol JSON document; ParseError for anything unacceptable."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ParseError("the body is not UTF-8") from None
    try:
        document = json.loads(text, parse_constant=reject_constant, parse_float=finite_float)
    except RecursionError:
        raise ParseError(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as exc:  # says where, never quotes the body
        raise ParseError(f"malformed JSON: {exc}") from None
    except ValueError as exc:  # an integer beyond sys.get_int_max_str_digits(), NaN, ±Infinity, 1e999
        reason = "an integer with too many digits" if "integer string conversion" in str(exc) else str(exc)
        raise ParseError(f"malformed JSON: {reason}") from None
    _check_tree(document)
    return document


class ProtocolJSONParser(BaseParser):
    """application/json with the limits above. The view has buffered the body
    (`buffer_body`), so `stream` is an in-memory, already capped copy."""

    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        return loads(stream.read())
