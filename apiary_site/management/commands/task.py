"""`apiary task add --source S --title T [--body B] [--workflow W]…`: a task by hand."""

import json

from django.core.management.base import BaseCommand, CommandError

from apiary_site import bootstrap
from workflows import services


class Command(BaseCommand):
    help = "Create a task by hand and dispatch its workflows."

    def add_arguments(self, parser):
        parser.add_argument("--config")
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="create a task and dispatch it")
        add.add_argument("--config", dest="config_sub")
        add.add_argument("--source", default="manual", help="a configured source id, or a label such as 'manual'")
        add.add_argument("--title", required=True)
        add.add_argument("--body", default="")
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
            payload = json.loads(options["payload"])
        except json.JSONDecodeError as exc:
            raise CommandError(f"--payload: not valid JSON ({exc})") from exc
        if not isinstance(payload, dict):
            raise CommandError("--payload: expected a JSON object")
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
        bootstrap.prepare_database(config)  # a task may be added before `apiary run` ever ran here
        task = services.task_add(source=source, title=options["title"], body=options["body"], payload=payload)
        jobs = services.dispatch(config=config, task=task, workflows=workflows)
        self.stdout.write(f"task {task.pk} ({task.source}:{task.item_key}) dispatched: " + ", ".join(
            f"instance {job.payload['instance_id']} ({job.payload['workflow']})" for job in jobs
        ))
