"""Which format Apiary's log lines take: `plain` (EscapingFormatter, the
default) or `json` (JsonFormatter, one object a line).

`$APIARY_LOG_FORMAT` wins, and settings.LOGGING reads it before anything
logs; `settings.log_format` in apiary.yaml is known only once the config is
loaded, so `apply` (bootstrap.apply, in every process) switches the handlers
of the `apiary` loggers then.
"""

import logging
import os

from jobqueue.text import EscapingFormatter, JsonFormatter

ENV = "APIARY_LOG_FORMAT"
FORMATS = ("plain", "json")
PLAIN = "%(asctime)s %(levelname)s %(name)s %(message)s"  # as settings.LOGGING's plain formatter

log = logging.getLogger("apiary.logs")


def chosen(config_format: str) -> str:
    """The format in force: $APIARY_LOG_FORMAT when it names one, else the config's."""
    wanted = os.environ.get(ENV, "")
    return wanted if wanted in FORMATS else config_format


def apply(config_format: str) -> None:
    fmt = chosen(config_format)
    formatter = JsonFormatter() if fmt == "json" else EscapingFormatter(PLAIN)
    for handler in logging.getLogger("apiary").handlers:
        handler.setFormatter(formatter)
    wanted = os.environ.get(ENV, "")
    if wanted and wanted not in FORMATS:
        log.warning("%s=%s is not one of %s: using %s", ENV, wanted, ", ".join(FORMATS), fmt)
