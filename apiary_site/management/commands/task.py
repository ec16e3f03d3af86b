"""`apiary task add --source S --title T [--body B] [--workflow W]…`: a task by hand."""

from django.core.management.base import CommandError

from apiary_site import bootstrap
from apiary_site.management.base import ApiaryCommand
from apiary_site.management.inputs import queue_database
from jobqueue import jsonlimits
from workflows import payload as workflow_payload
from workflows import services


class Command(ApiaryCommand):
    words = "task"
    help = "Create a task by hand and dispatch its workflows."

    def add_arguments(self, parser):
        parser.add_argument("--config", metavar="PATH", help="apiary.yaml (default: $APIARY_CONFIG, then ./apiary.yaml)")
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="create a task and dispatch it")
        add.add_argument("--config", dest="config_sub", metavar="PATH", help="apiary.yaml (default: $APIARY_CONFIG, then ./apiary.yaml)")
        add.add_argument("--source", default="manual", help="a configured source id, or a label such as 'manual'")
        add.add_argument("--title", required=True, help="the task's title")
        add.add_argument("--body", default="", help="the task's text (default: empty)")
        add.add_argument("--payload", default="{}", help="JSON object merged into the task payload")
        add.add_argument(
            "--workflow",
            action="append",
            default=[],
            help="workflow to dispatch (repeatable; default: the source's workflows)",
        )

    def handle(self, *args, **options):
        config = bootstrap.configure(options.get("config") or options.get("config_sub"))
        try:
            # NaN, ±Infinity and deep nesting are refused here, never by the database or a RecursionError.
            payload = jsonlimits.loads(options["payload"], max_depth=workflow_payload.TASK_PAYLOAD_DEPTH)
        except jsonlimits.JSONLimitError as exc:
            raise CommandError(f"--payload: {exc}") from None
        if not isinstance(payload, dict):
            raise CommandError("--payload: expected a JSON object")
        try:
            workflow_payload.task_payload_check(payload, what="--payload")
        except workflow_payload.PayloadError as exc:
            raise CommandError(str(exc)) from None
        source = options["source"]
        workflows = tuple(options["workflow"])
        if not workflows:
            if source not in config.sources:
                raise CommandError(
                    f"--source {source!r} is not a configured source ({', '.join(config.sources) or 'none'}); "
                    "name the workflows to run with --workflow"
                )
            workflows = config.sources[source].workflows
        unknown = [w for w in workflows if w not in config.workflows]
        if unknown:
            raise CommandError(f"unknown workflow(s) {', '.join(unknown)}; known: {', '.join(config.workflows)}")
        with queue_database():
            bootstrap.prepare_database(config)  # a task may be added before `apiary run` ever ran here
            task = services.task_add(source=source, title=options["title"], body=options["body"], payload=payload)
            try:
                jobs = services.dispatch(config=config, task=task, workflows=workflows)
            except workflow_payload.PayloadError as exc:  # the task's text makes the job's payload too large
                raise CommandError(f"task {task.pk} added, but not dispatched: {exc}") from None
        self.stdout.write(f"task {task.pk} ({task.source}:{task.item_key}) dispatched: " + ", ".join(
            f"instance {job.payload['instance_id']} ({job.payload['workflow']})" for job in jobs
        ))
