"""Apiary's admin site: Django's, branded, with the dashboard on its index page. VIEW SITE
leads back to that index (Apiary has no other site)."""

from django.contrib import admin

from jobqueue.clock import get_clock

from . import dashboard


class ApiaryAdminSite(admin.AdminSite):
    site_header = "Apiary"
    site_title = "Apiary"
    index_title = "Dashboard"
    site_url = "/admin/"
    index_template = "admin/apiary_index.html"

    def index(self, request, extra_context=None):
        extra = dict(extra_context or {})
        # Queue facts for those who may see queue rows; everyone else gets the app list alone.
        if request.user.has_perm("queue.view_job"):
            extra["dashboard"] = dashboard.context(now=get_clock().now())
        return super().index(request, extra)
