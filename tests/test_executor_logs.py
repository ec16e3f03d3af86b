"""The executor tells the job's log sender where each step's output begins and ends: a stream
per step, named by its history id, holding only this attempt's output although the step's
log file keeps every attempt's."""

import threading

from jobqueue.types import LogState
from tests.test_executor import GRACE, make_claim, make_executor
from tests.waiting import wait_for
from workers.logstream import LogSender


class Control:
    """A control plane's log endpoint: the text of each (attempt, stream), and whether it ended."""

    def __init__(self):
        self.text: dict[tuple[int, str], str] = {}
        self.ended: set[tuple[int, str]] = set()

    def log_append(self, *, attempt_id, token, stream, offset, text, final):
        key = (attempt_id, stream)
        self.text[key] = self.text.get(key, "") + text
        if final:
            self.ended.add(key)
        return LogState(stream, offset + len(text.encode()), 0, final, True)

    def close(self):
        pass


class Journal:
    """What the executor asks of a job's journal here: nothing recorded yet, writes accepted."""

    def __init__(self, logs):
        self.logs, self.checkpoint = logs, None

    def records(self):
        return {}

    def record(self, key, state, value):
        return None

    def record_before_finish(self, key, state, value):
        pass

    def checkpoint_sent(self, checkpoint):
        pass

    def checkpoint_flush(self):
        pass


def test_each_step_streams_only_this_attempts_output_under_its_history_id(tmp_path):
    executor = make_executor(tmp_path, 'echo "s1 of attempt $APIARY_ATTEMPT"', 'echo "s2 of attempt $APIARY_ATTEMPT"')
    control = Control()
    for attempt in (1, 2):
        claim = make_claim({"id": 3, "title": "t"}, attempt=attempt)
        claim = type(claim)(**{**claim.__dict__, "attempt_id": attempt})
        sender = LogSender(transport=control, claim=claim, interval=0.01)
        outcome = executor.run(claim, threading.Event(), grace=GRACE, journal=Journal(sender))
        assert outcome.outcome == "succeeded", outcome
        assert sender.close(timeout=10) is True
    assert control.text == {
        (1, "s1"): "s1 of attempt 1\n", (1, "s2"): "s2 of attempt 1\n",
        (2, "s1"): "s1 of attempt 2\n", (2, "s2"): "s2 of attempt 2\n",
    }  # fmt: skip
    assert control.ended == set(control.text)
    log = tmp_path / ".apiary" / "logs" / "5" / "s1.log"
    assert log.read_text() == "s1 of attempt 1\ns1 of attempt 2\n"  # the file keeps both; each stream one


def test_a_running_steps_output_streams_while_it_runs(tmp_path):
    go = tmp_path / "go"
    executor = make_executor(tmp_path, f'echo early; while [ ! -e "{go}" ]; do sleep 0.02; done; echo late')
    control = Control()
    claim = make_claim({"id": 3, "title": "t"})
    sender = LogSender(transport=control, claim=claim, interval=0.01)
    outcomes = []
    run = threading.Thread(target=lambda: outcomes.append(executor.run(claim, threading.Event(), grace=GRACE, journal=Journal(sender))))
    run.start()
    try:
        # The runner tells the sender it wrote output: the sender's thread starts and sends it, the step still running.
        wait_for(lambda: control.text.get((claim.attempt_id, "s1")) == "early\n", timeout=10, what="the first line, streamed")
    finally:
        go.touch()
        run.join(10)
    assert outcomes[0].outcome == "succeeded" and sender.close(timeout=10) is True
    assert control.text[(claim.attempt_id, "s1")] == "early\nlate\n"
