from django.apps import AppConfig


class JobQueueConfig(AppConfig):
    # Import name `jobqueue`, label `queue`: a top-level package named `queue`
    # would shadow the standard library module that urllib3 (and so requests) imports.
    name = "jobqueue"
    label = "queue"
    verbose_name = "Queue"
