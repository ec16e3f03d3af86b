"""Django settings for Apiary.

Apiary is configured by `apiary.yaml`, not by this module. What this module
decides is where the state lives and which database holds the queue:

* the config file is `$APIARY_CONFIG` (the `apiary` entry point sets it from
  `--config`), else `./apiary.yaml`; the state directory `.apiary/` sits
  beside it;
* the database is SQLite at `.apiary/apiary.db` (or `$APIARY_DB_PATH`), or
  PostgreSQL when `DATABASE_URL=postgres://…` is set.
"""

import datetime
import os
import secrets
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

CONFIG_PATH = Path(os.environ.get("APIARY_CONFIG", "apiary.yaml")).resolve()
STATE_DIR = Path(os.environ.get("APIARY_STATE_DIR", CONFIG_PATH.parent / ".apiary"))



def _secret_key() -> str:
    """The key that signs admin sessions (workers use the worker token instead).

    `$DJANGO_SECRET_KEY`, else a random key kept in `.apiary/secret_key`
    (mode 0600), made by the first process that needs it: every process of one
    state directory — the daemon, the listener's gunicorn workers — signs
    alike, and nothing guessable ever signs a session."""
    if os.environ.get("DJANGO_SECRET_KEY"):
        return os.environ["DJANGO_SECRET_KEY"]
    path = STATE_DIR / "secret_key"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    key = secrets.token_urlsafe(50)
    if not STATE_DIR.is_dir():  # no state yet: nothing this process signs outlives it
        return key
    draft = STATE_DIR / f".secret_key.{os.getpid()}"
    with os.fdopen(os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:  # never readable by others
        out.write(key)
    try:
        os.link(draft, path)  # atomic: of two processes racing here, one key wins
    except FileExistsError:
        key = path.read_text().strip()
    finally:
        draft.unlink()
    return key


SECRET_KEY = _secret_key()
DEBUG = os.environ.get("APIARY_DEBUG") == "1"
# Loopback only until apiary.yaml is in force: bootstrap.apply sets the
# listener's hosts, TLS and cookie settings from settings.queue
# (apiary_site.security), in every process before it serves anything.
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "[::1]"]

INSTALLED_APPS = [
    "apiary_site.apps.ApiaryAdminConfig",  # django.contrib.admin with Apiary's site and dashboard
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "axes",  # admin login throttling
    "jobqueue.apps.JobQueueConfig",
    "workflows.apps.WorkflowsConfig",
    "apiary_site",  # the management commands: they parse arguments and wire the layers
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "apiary_site.middleware.ContentSecurityPolicyMiddleware",
    "axes.middleware.AxesMiddleware",  # last, as django-axes requires
]

# The admin's headers (the worker protocol answers JSON and gets SecurityMiddleware's only).
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
# Django's admin has no inline script or style: everything comes from /static/.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; font-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SESSION_COOKIE_HTTPONLY = True
# SECURE_* (HSTS, redirect, proxy header) and the Secure cookies follow
# settings.queue.tls: apiary_site.security.

# Admin logins: 5 failures lock that username, and that client address, for
# 15 minutes (django-axes, recorded in the database so every listener process
# counts alike). `apiary axes_reset_username NAME` lifts a lock early.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = 5
AXES_COOLOFF_TIME = datetime.timedelta(minutes=15)
AXES_LOCKOUT_PARAMETERS = ["ip_address", "username"]
AXES_CLIENT_IP_CALLABLE = "apiary_site.security.client_ip"
AXES_VERBOSE = False  # its own log lines at every start; lockouts still log a warning

ROOT_URLCONF = "apiary_site.urls"
WSGI_APPLICATION = "apiary_site.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


# The listener's processes serve ASGI (apiary_site.listener). The worker
# protocol runs in fixed thread pools (jobqueue.api.asgi, jobqueue.longpoll),
# whose threads keep their SQLite connection as every long-running process
# does. PostgreSQL connections there come from a pool (Django 5.1+,
# psycopg_pool; pooling needs CONN_MAX_AGE 0) and go back after each call.
ASGI = os.environ.get("APIARY_ASGI") == "1"
# 16 protocol threads + 4 claim threads per process (jobqueue.api.asgi, jobqueue.longpoll), and the admin.
PG_POOL = {"min_size": 2, "max_size": int(os.environ.get("APIARY_PG_POOL_SIZE", "24")), "timeout": 10}


def _prepare_threshold(text: str) -> int | None:
    if text.strip().lower() in ("", "none", "off"):
        return None
    try:
        return int(text)
    except ValueError:
        raise ImproperlyConfigured(f"DATABASE_URL: prepare_threshold must be a whole number or none, got {text!r}") from None


def _postgres(url: str) -> dict:
    parts = urlsplit(url)
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    # Django's cursors bind on the client and never prepare; a threshold lets the queue's
    # hottest statements be prepared (jobqueue.sql.prepared_cursor), and nothing else.
    # `?prepare_threshold=none` turns that off (a pooler that cannot keep prepared statements).
    options["prepare_threshold"] = _prepare_threshold(options.get("prepare_threshold", "5"))
    if ASGI:
        options["pool"] = PG_POOL
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        # Long-running processes keep their connection; close_old_connections()
        # in each loop drops a broken one. A reconnect per job costs more than the job.
        "CONN_MAX_AGE": 0 if ASGI else None,
        "CONN_HEALTH_CHECKS": not ASGI,  # the pool checks its connections itself
        "OPTIONS": options,
        "TEST": {"NAME": os.environ.get("APIARY_TEST_DB_NAME")} if os.environ.get("APIARY_TEST_DB_NAME") else {},
    }


def _sqlite(path: Path) -> dict:
    return {
        "ENGINE": "jobqueue.sqlite_backend",  # Django's, with placeholder conversion cached
        "NAME": str(path),
        "CONN_MAX_AGE": None,
        "OPTIONS": {
            # IMMEDIATE: every transaction takes the write lock at BEGIN, so two
            # claimers never read the same queued row and then collide on the
            # lock upgrade (Django drops select_for_update on SQLite).
            "transaction_mode": "IMMEDIATE",
            # Seconds a writer waits for the lock before "database is locked".
            "timeout": float(os.environ.get("APIARY_SQLITE_TIMEOUT", "30")),
            "init_command": (
                "PRAGMA journal_mode=WAL;"
                f"PRAGMA synchronous={os.environ.get('APIARY_SQLITE_SYNCHRONOUS', 'FULL')};"
                "PRAGMA foreign_keys=ON;"
            ),
        },
    }


_database_url = os.environ.get("DATABASE_URL", "")
if _database_url.startswith(("postgres://", "postgresql://")):
    DATABASES = {"default": _postgres(_database_url)}
elif _database_url:
    raise ImproperlyConfigured(f"DATABASE_URL must start with postgres:// or postgresql://, got {_database_url.split(':', 1)[0]}://…")
else:
    DATABASES = {"default": _sqlite(Path(os.environ.get("APIARY_DB_PATH", STATE_DIR / "apiary.db")))}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
FORMAT_MODULE_PATH = ["apiary_site.formats"]  # times to the second
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"

# Worker protocol bodies are small JSON documents; 1 MiB is the documented limit.
DATA_UPLOAD_MAX_MEMORY_SIZE = 1024 * 1024

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["jobqueue.api.auth.WorkerTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "EXCEPTION_HANDLER": "jobqueue.api.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Apiary worker protocol",
    "DESCRIPTION": "Version 1 of the protocol between the Apiary control plane and its remote workers.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # PROTOCOL.md: every request carries the worker token, the schema's too.
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    "SERVE_AUTHENTICATION": ["jobqueue.api.auth.WorkerTokenAuthentication"],
    # Separate request components, so required strings say minLength 1 and
    # request bodies can say additionalProperties: false.
    "COMPONENT_SPLIT_REQUEST": True,
    # One name for the outcome choices a finish sends and a status hook entry names.
    "ENUM_NAME_OVERRIDES": {
        "OutcomeEnum": "jobqueue.types.OUTCOMES",
        # Three `state` fields (a record's, an instance's job's in its logs document) get a name each.
        "RecordStateEnum": "jobqueue.types.RECORD_STATES",
        "JobStateEnum": "jobqueue.models.JobState",
    },
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "jobqueue.api.schema.close_request_objects",
    ],
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"()": "jobqueue.text.EscapingFormatter", "format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "jobqueue.text.JsonFormatter"},  # one JSON object a line (apiary_site.logformat)
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "json" if os.environ.get("APIARY_LOG_FORMAT") == "json" else "plain",
        }
    },
    "loggers": {
        "apiary": {"handlers": ["console"], "level": os.environ.get("APIARY_LOG_LEVEL", "INFO"), "propagate": False},
    },
}
