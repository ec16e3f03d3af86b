"""Where a remote worker keeps the credential its enrolment gave it:
`.apiary/workers/<worker-id>.credential`, mode 0600, written atomically
(a crash leaves the old file or the new one, never half of one)."""

import logging
import os
from pathlib import Path

log = logging.getLogger("apiary.worker")


class CredentialFile:
    def __init__(self, path: Path):
        self.path = Path(path)

    def load(self) -> str | None:
        try:
            secret = self.path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("cannot read the worker credential in %s (%s); enrolling again", self.path, exc)
            return None
        return secret or None

    def save(self, secret: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        draft = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, secret.encode("ascii") + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(draft, 0o600)  # whatever the umask
        os.replace(draft, self.path)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
