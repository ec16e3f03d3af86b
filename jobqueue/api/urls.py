"""Routes of worker protocol 1, mounted at /api/worker/v1/ (apiary_site.urls).

Path parameters are constrained here (worker ids by the protocol's pattern,
attempt ids to 18 digits so they fit a 64-bit column); anything that does not
match falls through to the JSON 404 at the end.
"""

from django.urls import path, re_path

from . import views
from .serializers import WORKER_ID_PATTERN

urlpatterns = [
    path("workers/register", views.RegisterView.as_view(), name="worker-register"),
    re_path(
        rf"^workers/(?P<worker_id>{WORKER_ID_PATTERN})/heartbeat\Z",
        views.WorkerHeartbeatView.as_view(),
        name="worker-heartbeat",
    ),
    path("claims", views.ClaimView.as_view(), name="claims"),
    re_path(
        r"^attempts/(?P<attempt_id>[0-9]{1,18})/heartbeat\Z",
        views.AttemptHeartbeatView.as_view(),
        name="attempt-heartbeat",
    ),
    re_path(r"^attempts/(?P<attempt_id>[0-9]{1,18})/finish\Z", views.FinishView.as_view(), name="attempt-finish"),
    re_path(r"^attempts/(?P<attempt_id>[0-9]{1,18})/records\Z", views.AttemptRecordView.as_view(), name="attempt-records"),
    re_path(
        r"^attempts/(?P<attempt_id>[0-9]{1,18})/records/list\Z", views.AttemptRecordsView.as_view(), name="attempt-records-list"
    ),
    re_path(r"^attempts/(?P<attempt_id>[0-9]{1,18})/logs\Z", views.AttemptLogView.as_view(), name="attempt-logs"),
    path("status", views.StatusView.as_view(), name="status"),
    path("schema/", views.SchemaView.as_view(), name="schema"),
    re_path(r"", views.UnknownPathView.as_view()),
]
