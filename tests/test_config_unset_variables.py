"""`load(…, unset_ok=…)`: commands that never use some values a `${VAR}`
fills in need not have the variable set. Under the key paths named, an unset
variable leaves its key absent with no error (and no error about what needed
it, such as `listen` wanting a worker_token); everywhere else it is the usual
error."""

import pytest

from workflows.config import ConfigError, load

CONFIG = """\
settings:
  queue:
    listen: 127.0.0.1:8799
    worker_token: ${APIARY_WORKER_TOKEN}
    previous_worker_tokens: ["${APIARY_OLD_WORKER_TOKEN}"]
agents: [{id: sh, runner: shell, command: cat, env: {GH_TOKEN: "${GH_TOKEN}"}}]
workflows: [{id: w, agent: sh, steps: [{id: s, run: "true"}]}]
sources: []
"""


@pytest.fixture
def path(tmp_path):
    (tmp_path / "apiary.yaml").write_text(CONFIG)
    return tmp_path / "apiary.yaml"


def test_unset_variables_are_errors_by_default(path):
    with pytest.raises(ConfigError) as raised:
        load(path, environ={})
    text = str(raised.value)
    assert "APIARY_WORKER_TOKEN is not set" in text and "GH_TOKEN is not set" in text


def test_under_settings_queue_they_may_be_unset_elsewhere_not(path):
    with pytest.raises(ConfigError) as raised:
        load(path, environ={}, unset_ok=("settings.queue",))
    assert raised.value.errors == [raised.value.errors[0]] and "GH_TOKEN is not set" in raised.value.errors[0]
    config = load(path, environ={"GH_TOKEN": "x"}, unset_ok=("settings.queue",))
    assert config.settings.queue.worker_token is None and config.settings.queue.previous_worker_tokens == ()
    assert config.settings.queue.listen == "127.0.0.1:8799"


def test_everywhere_for_commands_that_use_none(path):
    config = load(path, environ={}, unset_ok=("",))
    assert config.settings.queue.worker_token is None
    assert config.agents["sh"].env == {}


def test_a_set_variable_is_used_and_checked_as_always(path):
    with pytest.raises(ConfigError, match="worker_token: starts with 'apw_'"):
        load(path, environ={"APIARY_WORKER_TOKEN": "apw_" + "x" * 40}, unset_ok=("",))
