from django.contrib import admin
from django.contrib.staticfiles.views import serve as serve_static
from django.urls import include, path, re_path

from apiary_site.monitoring import healthz_view, metrics_view
from jobqueue.api.views import UnsupportedProtocolView

urlpatterns = [
    path("admin/", admin.site.urls),
    # Monitoring (apiary_site.monitoring): Prometheus scrapes, health probes.
    path("metrics", metrics_view),
    path("healthz", healthz_view),
    # The admin's own CSS and JS, straight from the installed apps: the
    # listener is the only web server Apiary has, and there is no collectstatic step.
    re_path(r"^static/(?P<path>.*)$", serve_static, {"insecure": True}),
    path("api/worker/v1/", include("jobqueue.api.urls")),
    # Any other version (or none) under /api/worker: a JSON 404 `unsupported_protocol`.
    re_path(r"^api/worker(?:/|\Z)", UnsupportedProtocolView.as_view()),
]
