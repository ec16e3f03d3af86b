"""The ASGI application the listener serves: Django, with `POST claims`
served in front of it (jobqueue.api.asgi): a waiting long-poll
holds no thread."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")

django_application = get_asgi_application()

from jobqueue.api.asgi import with_worker_protocol  # noqa: E402 - needs the apps loaded

application = with_worker_protocol(django_application)
