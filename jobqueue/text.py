"""Text as both database backends can store it.

Used wherever outside text enters a row or a process: source items, task
snapshots, errors and summaries. It needs no database, so the remote worker
uses it too.
"""

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
