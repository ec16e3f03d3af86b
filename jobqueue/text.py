"""Text as both database backends can store it.

Used wherever outside text enters a row or a process: source items, task
snapshots, errors and summaries; and, escaped, wherever it enters a log line
(`EscapingFormatter`). It needs no database, so the remote worker uses it too.
"""

import datetime as dt
import json
import logging
import re

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def clean(value):
    """Strings as both backends store them: NUL (refused by PostgreSQL text and
    jsonb) and lone surrogates (not encodable as UTF-8) become U+FFFD, inside
    dicts and lists too."""
    if isinstance(value, str):
        return _UNSTORABLE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {clean(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def has_unstorable(text: str) -> bool:
    """Whether `text` holds what clean replaces (a JSON text written with ensure_ascii=False
    shows a NUL as the escape `\\u0000` instead, and a lone surrogate as itself)."""
    return _UNSTORABLE.search(text) is not None


# C0 controls but tab, DEL, C1 controls, and the Unicode line and paragraph separators: each could
# end a log line early (\n, \r, NEL, U+2028), rewrite what a terminal shows (ESC sequences,
# backspace) or hide text. A tab is kept: it cannot start a line.
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r"}


def escape_controls(text: str) -> str:
    """`text` with every control character written as an escape (`\\n`, `\\r`,
    `\\x1b`, `\\u2028`), so it stays on one line and shows as what it is."""
    return _CONTROL.sub(lambda m: _NAMED.get(m.group(), m.group().encode("unicode_escape").decode("ascii")), text)


class EscapingFormatter(logging.Formatter):
    """A log formatter that keeps each record on its lines: the rendered
    message is passed through `escape_controls`, so a file name, a task title
    or an error message with a newline in it cannot forge a log line. A
    traceback keeps its lines, each indented and escaped, so nothing in it
    starts a line of its own either. Installed for every `apiary` logger in
    settings.LOGGING."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        record.message = escape_controls(message)
        try:
            return super().formatMessage(record)
        finally:
            record.message = message

    def formatException(self, ei) -> str:
        return self._indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return self._indented(super().formatStack(stack_info))

    @staticmethod
    def _indented(text: str) -> str:
        return "\n".join("    " + escape_controls(line) for line in text.splitlines())


# The attributes every LogRecord has; anything else on a record came from `extra=` and is logged as a field.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
# What json.dumps leaves as is (ensure_ascii off, for readable text) but could still end a line or
# rewrite a terminal, and lone surrogates, which no UTF-8 stream could write.
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff]")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: time (UTC, RFC 3339), level,
    logger, message and the record's `extra` fields; a traceback is the
    `exception` string. JSON escapes newlines and C0 controls; DEL, C1
    controls, the Unicode separators and lone surrogates, which it would leave raw, are
    written as `\\u` escapes too, so — as with `EscapingFormatter` — no text
    in a record can start a line or pass for one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": _rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _RECORD_ATTRIBUTES and name not in entry and not name.startswith("_"):
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        line = json.dumps(entry, ensure_ascii=False, default=str, separators=(",", ":"))
        return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", line)


def _rfc3339(created: float) -> str:
    return dt.datetime.fromtimestamp(created, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
