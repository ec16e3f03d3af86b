# The module, not the class: Django would take an AppConfig class found in this module's
# namespace for the `apiary_site` app's own config.
from django.contrib.admin import apps as admin_apps


class ApiaryAdminConfig(admin_apps.AdminConfig):
    """Django's admin with Apiary's site (apiary_site.admin_site): its branding and dashboard."""

    default = False  # not the config of the `apiary_site` app itself
    default_site = "apiary_site.admin_site.ApiaryAdminSite"
