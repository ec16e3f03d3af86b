"""The ASGI application the listener serves: the worker protocol
(jobqueue.api.asgi, where a waiting long-poll holds no thread) in front of
Django's handler, which serves the admin. Each process starts its wake-up
watcher before it serves anything."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")

django_application = get_asgi_application()

from jobqueue.api.asgi import with_worker_protocol  # noqa: E402 - needs the apps loaded
from jobqueue.wakeup import watch  # noqa: E402

application = with_worker_protocol(django_application)
watch.ensure_running().wait(10)
