from django.contrib import admin
from django.contrib.staticfiles.views import serve as serve_static
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from jobqueue.api.views import UnsupportedProtocolView

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),  # the dashboard: Apiary has no other page
    path("admin/", admin.site.urls),
    # The admin's own CSS and JS, straight from the installed apps: the
    # listener is the only web server Apiary has, and there is no collectstatic step.
    re_path(r"^static/(?P<path>.*)$", serve_static, {"insecure": True}),
    path("api/worker/v1/", include("jobqueue.api.urls")),
    # Any other version (or none) under /api/worker: a JSON 404 `unsupported_protocol`.
    re_path(r"^api/worker(?:/|\Z)", UnsupportedProtocolView.as_view()),
]
