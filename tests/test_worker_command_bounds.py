"""`apiary worker` refuses, before it connects anywhere, what the control
plane would refuse anyway: a capacity above the registration bound and the
reserved id `embedded` (exit 2, a message naming the option)."""

import io

import pytest
from django.core.management import CommandError, call_command

from apiary_site.management.commands import worker as worker_command
from jobqueue.types import MAX_CAPACITY


class Connected(Exception):
    pass


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path):
    def connect(**kwargs):
        raise Connected

    monkeypatch.setattr(worker_command, "HttpTransport", connect)
    monkeypatch.setenv("APIARY_WORKER_TOKEN", "t" * 40)
    (tmp_path / "apiary.yaml").write_text("project: w\n")
    monkeypatch.chdir(tmp_path)


def worker(*args):
    call_command("worker", "--control-plane", "http://cp:8080", "--config", "apiary.yaml", *args,
                 stderr=io.StringIO())  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--id", "w1", "--capacity", str(MAX_CAPACITY + 1)), f"--capacity must be 1–{MAX_CAPACITY}"),
        (("--id", "w1", "--capacity", "1000000000"), "--capacity must be"),
        (("--id", "w1", "--capacity", "0"), "--capacity must be"),
        (("--id", "embedded"), "reserved"),
    ],
)
def test_refused_before_connecting(args, message):
    with pytest.raises(CommandError, match=message) as refused:
        worker(*args)
    assert refused.value.returncode == 2


def test_the_largest_capacity_gets_as_far_as_connecting():
    with pytest.raises(Connected):
        worker("--id", "w1", "--capacity", str(MAX_CAPACITY))
