"""What a remote worker keeps of its identity, in `.apiary/workers/`:

* `<worker-id>.credential`: the control plane's URL and the credential its
  enrolment gave, 0600, written atomically (a crash leaves the old file or
  the new one, never half of one). It is sent only to the control plane it
  came from: pointed at another URL, the worker refuses to start rather
  than hand one control plane's credential to another.
* `<worker-id>.enrolment`: while the worker has no credential, the random
  key it sends with its enrolment, kept before the first try so that a
  retry after a lost answer sends the same one (the control plane then
  answers again instead of refusing an id it has just enrolled).
"""

import logging
import os
import re
import secrets
from pathlib import Path

from jobqueue.types import ENROLLMENT_KEY_PATTERN

from . import private

log = logging.getLogger("apiary.worker")

CREDENTIAL_RE = re.compile(r"apw_[A-Za-z0-9_-]{20,128}")


class CredentialElsewhere(Exception):
    """The stored credential belongs to another control plane."""


def _write_private(path: Path, text: str) -> None:
    """`text` into `path` (0600) atomically: a draft beside it, synced, renamed over it."""
    private.private_dir(path.parent)
    draft = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with private.open_private(draft, "w", encoding="ascii") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(draft, path)
    finally:
        draft.unlink(missing_ok=True)


class CredentialFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.key_path = self.path.with_suffix(".enrolment")

    def load(self, url: str) -> str | None:
        """The stored credential for `url`; None when there is none.
        CredentialElsewhere when it was issued by another control plane."""
        try:
            lines = self.path.read_text(encoding="ascii").split()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise CredentialElsewhere(f"cannot read the worker credential in {self.path}: {exc}") from exc
        if len(lines) != 2 or not CREDENTIAL_RE.fullmatch(lines[1]):
            raise CredentialElsewhere(f"{self.path} is not a worker credential file (delete it to enrol again)")
        if lines[0] != url:
            raise CredentialElsewhere(
                f"{self.path} holds the credential of the control plane at {lines[0]}, not {url}; "
                "delete it to enrol this worker with the new one"
            )
        return lines[1]

    def save(self, url: str, secret: str) -> None:
        _write_private(self.path, f"{url}\n{secret}\n")
        self.key_path.unlink(missing_ok=True)  # enrolled: the key has done its job

    def enrolment_key(self) -> str:
        """The key of this worker's enrolment: the one kept from an earlier try, else a new one, kept now."""
        try:
            key = self.key_path.read_text(encoding="ascii").strip()
            if re.fullmatch(ENROLLMENT_KEY_PATTERN, key):
                return key
        except (OSError, UnicodeDecodeError):
            pass
        key = secrets.token_urlsafe(32)
        _write_private(self.key_path, key + "\n")
        return key
