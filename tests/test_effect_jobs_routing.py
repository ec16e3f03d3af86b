"""A workflow job with publish or spawn steps requires `apiary.effects` of its
worker (workflows/services.py EFFECTS_CAPABILITY): a worker from before effect
steps would run the publish with no ledger, again after a done one, and a
spawn step as a plain step. Workers of this version advertise it."""

import pytest

from jobqueue import services as queue
from jobqueue.selectors import status_document
from tests.factories import make_task
from workflows.config import load
from workflows.services import EFFECTS_CAPABILITY, dispatch, worker_capabilities

pytestmark = pytest.mark.django_db

CONFIG = """
project: fx
agents: [{id: sh, runner: shell, command: cat}]
workflows:
  - id: ship
    agent: sh
    steps: [{id: build, run: "true"}, {id: release, run: ./release.sh, publish: true}]
  - id: split
    agent: sh
    steps: [{id: split, run: ./split.sh, spawn: true}]
  - id: plain
    agent: sh
    steps: [{id: work, run: "true"}]
"""


@pytest.fixture
def config(tmp_path):
    (tmp_path / "apiary.yaml").write_text(CONFIG)
    return load(tmp_path / "apiary.yaml", environ={})


def capabilities_of(job) -> list[str]:
    return sorted(job.requirements.capabilities)


def test_only_jobs_with_effect_steps_require_apiary_effects(config, clock):
    ship, split, plain = dispatch(config=config, task=make_task(source="inbox"), workflows=("ship", "split", "plain"))
    assert EFFECTS_CAPABILITY in capabilities_of(ship) and EFFECTS_CAPABILITY in capabilities_of(split)
    assert capabilities_of(plain) == ["apiary.workflow", "runner:shell"]
    assert EFFECTS_CAPABILITY in worker_capabilities(["shell"])


def test_a_worker_without_it_takes_only_the_plain_job_and_the_others_say_why(config, clock):
    ship, plain = dispatch(config=config, task=make_task(source="inbox"), workflows=("ship", "plain"))
    old = queue.worker_register(worker_id="old", capabilities=["apiary.workflow", "apiary.hooks", "runner:shell"])
    claimed = queue.jobs_claim(worker_id="old", session=old.session, max_jobs=2)
    assert [c.job_id for c in claimed] == [plain.pk]
    assert {b["job_id"]: b["reason"] for b in status_document()["blocked"]} == {
        ship.pk: "missing capability apiary.effects"
    }
