from django.contrib import admin
from django.contrib.staticfiles.views import serve as serve_static
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from apiary_site.monitoring import healthz_view, metrics_view
from jobqueue.api.views import UnsupportedProtocolView
from jobqueue.types import LOG_STREAM_PATTERN
from workflows.api import InstanceLogsView, InstanceLogTextView

# Protocol reads the workflows layer answers (what an instance's logs are is its own), ahead of
# the queue's routes, whose last one answers every other path under v1 with a JSON 404.
WORKFLOW_PROTOCOL = [
    re_path(r"^api/worker/v1/instances/(?P<instance_id>[0-9]{1,18})/logs\Z", InstanceLogsView.as_view(), name="instance-logs"),
    re_path(
        rf"^api/worker/v1/instances/(?P<instance_id>[0-9]{{1,18}})/logs/(?P<attempt_number>[0-9]{{1,9}})"
        rf"/(?P<step>{LOG_STREAM_PATTERN})/(?P<offset>[0-9]{{1,19}})\Z",
        InstanceLogTextView.as_view(),
        name="instance-log-text",
    ),
]

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),  # the dashboard: Apiary has no other page
    path("admin/", admin.site.urls),
    # Monitoring (apiary_site.monitoring): Prometheus scrapes, health probes.
    path("metrics", metrics_view),
    path("healthz", healthz_view),
    # The admin's own CSS and JS, straight from the installed apps: the
    # listener is the only web server Apiary has, and there is no collectstatic step.
    re_path(r"^static/(?P<path>.*)$", serve_static, {"insecure": True}),
    *WORKFLOW_PROTOCOL,
    path("api/worker/v1/", include("jobqueue.api.urls")),
    # Any other version (or none) under /api/worker: a JSON 404 `unsupported_protocol`.
    re_path(r"^api/worker(?:/|\Z)", UnsupportedProtocolView.as_view()),
]
