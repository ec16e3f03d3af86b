from django.contrib import admin
from django.urls import include, path, re_path

from jobqueue.api.views import UnsupportedProtocolView

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/worker/v1/", include("jobqueue.api.urls")),
    # Any other version (or none) under /api/worker: a JSON 404 `unsupported_protocol`.
    re_path(r"^api/worker(?:/|\Z)", UnsupportedProtocolView.as_view()),
]
