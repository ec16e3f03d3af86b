"""The worker's log sender (workers/logstream.py) on its own: it never makes the step wait,
it holds one chunk at a time however much a step prints (skipping to the tail the control
plane keeps), it cuts chunks at whole UTF-8 characters, and its thread starts only when
there is output to stream."""

import threading

from jobqueue.types import MAX_LOG_CHUNK_BYTES, MAX_LOG_STREAM_BYTES, Claim, LogState
from tests.waiting import wait_for
from workers.logstream import READ_BYTES, LogSender, complete_prefix, text_of

WAIT = 10.0
CLAIM = Claim(job_id=1, attempt_id=7, attempt_number=1, token="t", lease_expires_at=None, agent="a", runner="shell", payload={})


class Recorder:
    """A control plane that keeps what it is sent (by offset), or hangs until released."""

    def __init__(self, *, hang: bool = False):
        self.chunks: list[dict] = []
        self.hang = threading.Event() if hang else None
        self.sending = threading.Event()  # a send has begun

    def log_append(self, **chunk) -> LogState:
        self.sending.set()
        if self.hang is not None:
            self.hang.wait()
        self.chunks.append(chunk)
        end = chunk["offset"] + len(chunk["text"].encode())
        return LogState(chunk["stream"], end, 0, chunk["final"], True)

    def close(self) -> None:
        pass


def test_the_step_never_waits_for_a_control_plane_that_does_not_answer(tmp_path):
    transport = Recorder(hang=True)
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01)
    path = tmp_path / "step.log"
    sender.step_started("plan", path)
    path.write_text("output\n")
    sender.output_written()  # as the runner says after it wrote the step's output
    sender.step_ended("plan")  # returns although the send of the output hangs
    assert transport.sending.wait(WAIT)
    assert sender.close(timeout=0) is False  # the finish goes on; the logs were not all sent
    transport.hang.set()
    sender.thread.join(WAIT)


def test_more_than_is_kept_is_skipped_to_the_tail_one_chunk_at_a_time(tmp_path):
    transport = Recorder()
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01)
    path = tmp_path / "step.log"
    path.write_bytes(b"")
    sender.step_started("plan", path)
    # All at once (a rename), so the sender never sees part of it: the step printed 3 MiB between two reads.
    whole = tmp_path / "step.log.new"
    whole.write_bytes(b"a" * (3 * MAX_LOG_STREAM_BYTES) + b"the end\n")
    whole.replace(path)
    sender.step_ended("plan")
    assert sender.close(timeout=WAIT) is True
    assert all(len(c["text"].encode()) <= min(READ_BYTES, MAX_LOG_CHUNK_BYTES) for c in transport.chunks)
    sent = sum(len(c["text"]) for c in transport.chunks)
    assert sent <= MAX_LOG_STREAM_BYTES  # not the 3 MiB the step printed
    # The tail arrives whole; the final mark may ride on an empty chunk when the sender had read
    # to the file's end before the step was told to have ended.
    assert transport.chunks[0]["offset"] > 0 and "".join(c["text"] for c in transport.chunks).endswith("the end\n")
    assert transport.chunks[-1]["final"] and transport.chunks[-1]["offset"] + len(transport.chunks[-1]["text"]) == path.stat().st_size


def test_chunks_end_at_whole_characters_and_offsets_count_the_text_sent(tmp_path):
    transport = Recorder()
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01)
    path = tmp_path / "step.log"
    path.write_bytes(b"")
    sender.step_started("plan", path)
    path.write_bytes("é".encode() * READ_BYTES + b"\xff\x00 bad bytes\n")
    sender.step_ended("plan")
    assert sender.close(timeout=WAIT) is True
    text = "".join(c["text"] for c in transport.chunks)
    assert text == "é" * READ_BYTES + "\ufffd\ufffd bad bytes\n"
    offset = 0
    for chunk in transport.chunks:
        assert chunk["offset"] == offset
        offset += len(chunk["text"].encode())


def test_complete_prefix_keeps_an_unfinished_character_for_the_next_read():
    data = "aé€😀".encode()
    assert complete_prefix(data) == len(data)
    assert complete_prefix(data[:-1]) == len(data) - 4
    assert complete_prefix(data[:-2]) == len(data) - 4
    assert complete_prefix("é".encode()[:1]) == 0
    assert text_of(b"a\x00b") == "a\ufffdb"


def test_a_stopped_sender_sends_nothing_more(tmp_path):
    transport = Recorder()
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01)
    path = tmp_path / "step.log"
    path.write_text("one\n")
    sender.step_started("plan", path)
    path.write_text("one\ntwo\n")
    sender.output_written()
    wait_for(lambda: transport.chunks, timeout=WAIT, what="a first chunk")
    sender.stop()
    sender.thread.join(WAIT)
    count = len(transport.chunks)
    sender.step_started("later", path)
    sender.step_ended("later")
    assert sender.close(timeout=0) in (True, False) and len(transport.chunks) == count


def test_on_the_workers_job_threads_a_sender_sends_all_and_leaves_its_thread_for_the_next_job(tmp_path):
    from workers.jobthreads import JobThreads

    pool = JobThreads(idle_seconds=30)
    senders = []  # the thread each job's sender sent on
    for n in range(2):
        transport = Recorder()
        transport.log_append = lambda append=transport.log_append, **chunk: (
            senders.append(threading.get_ident()) or append(**chunk)
        )
        sender = LogSender(transport=transport, claim=CLAIM, interval=0.01, threads=pool)
        path = tmp_path / f"step{n}.log"
        sender.step_started("plan", path)
        path.write_text("output\n")
        sender.step_ended("plan")
        assert sender.close(timeout=WAIT) is True
        # The sender may look at the file between the write and the step's end: one chunk or two.
        assert "".join(c["text"] for c in transport.chunks) == "output\n" and transport.chunks[-1]["final"]
        wait_for(lambda: len(pool._idle) == 1, timeout=WAIT, what="the sender's thread to be idle again")
    assert len(set(senders)) == 1 and senders[0] != threading.get_ident()  # both jobs' chunks, one pool thread


def test_a_step_that_prints_nothing_still_ends_its_stream(tmp_path):
    # `apiary logs` and the console list an attempt's steps by their streams: a quiet step is listed, empty.
    transport = Recorder()
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01)
    path = tmp_path / "quiet.log"
    path.write_text("an earlier attempt's output\n")  # the step's output begins after it
    sender.step_started("quiet", path)
    sender.step_ended("quiet")
    assert sender.close(timeout=WAIT) is True
    assert transport.chunks == [{"attempt_id": 7, "token": "t", "stream": "quiet", "offset": 0, "text": "", "final": True}]


class Deferring(Recorder):
    """The embedded worker's transport: it can also queue a chunk to commit with a later call."""

    def __init__(self):
        super().__init__()
        self.later: list[dict] = []

    def log_append_later(self, **chunk) -> None:
        self.later.append(chunk)


def test_in_the_embedded_worker_a_final_chunk_is_queued_to_commit_with_the_finish_not_waited_for(tmp_path):
    transport = Deferring()
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01, defer_final=True)
    path = tmp_path / "step.log"
    sender.step_started("plan", path)
    path.write_text("output\n")
    sender.step_ended("plan")
    assert sender.close(timeout=WAIT) is True
    [final] = transport.later
    assert final["final"] and not any(c["final"] for c in transport.chunks)  # never waited for
    assert "".join(c["text"] for c in transport.chunks) + final["text"] == "output\n"
    sender.resend_deferred()  # the runtime, before it sends a failed finish again
    assert transport.later == [final, final]


def test_a_sender_whose_finish_does_not_follow_waits_for_every_chunk(tmp_path):
    transport = Deferring()
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01)  # no defer_final: a direct caller's
    path = tmp_path / "step.log"
    sender.step_started("plan", path)
    sender.step_ended("plan")
    assert sender.close(timeout=WAIT) is True
    assert transport.later == [] and transport.chunks[-1]["final"]


def test_the_senders_thread_starts_at_the_steps_first_output_not_at_its_start(tmp_path):
    transport = Recorder()
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01)
    path = tmp_path / "step.log"
    sender.step_started("plan", path)
    assert sender.thread is None  # the step runs, and has printed nothing: nothing to look at
    path.write_text("output\n")
    sender.output_written()
    assert sender.thread is not None
    wait_for(lambda: transport.chunks, timeout=WAIT, what="the output, sent while the step runs")
    sender.step_ended("plan")
    assert sender.close(timeout=WAIT) is True


def test_in_the_embedded_worker_a_short_steps_log_is_queued_by_the_closing_thread_without_a_thread_of_its_own(tmp_path):
    transport = Deferring()
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01, defer_final=True)
    quiet, short = tmp_path / "quiet.log", tmp_path / "short.log"
    sender.step_started("quiet", quiet)
    sender.step_ended("quiet")
    sender.step_started("short", short)
    short.write_text("a line the step wrote before the sender looked\n")  # no output_written: e.g. the executor's own note
    sender.step_ended("short")
    assert sender.close(timeout=WAIT) is True
    assert sender.thread is None and transport.chunks == []
    assert [(c["stream"], c["offset"], c["text"], c["final"]) for c in transport.later] == [
        ("quiet", 0, "", True), ("short", 0, "a line the step wrote before the sender looked\n", True),
    ]  # fmt: skip


def test_a_rest_longer_than_a_chunk_is_sent_by_the_senders_thread_even_in_the_embedded_worker(tmp_path):
    transport = Deferring()
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01, defer_final=True)
    path = tmp_path / "step.log"
    sender.step_started("plan", path)
    path.write_bytes(b"x" * (2 * READ_BYTES + 5))
    sender.step_ended("plan")
    assert sender.close(timeout=WAIT) is True
    assert sender.thread is not None  # the chunks before the last are waited for, off the closing thread
    [final] = transport.later
    assert len(transport.chunks) == 2 and len("".join(c["text"] for c in transport.chunks) + final["text"]) == 2 * READ_BYTES + 5


def test_once_stopped_a_sender_queues_no_final_chunk(tmp_path):
    # The runtime sends the finish once close() (which stops the sender) returned: a final chunk
    # queued by a sender thread still running would commit after it, and be refused as stale.
    transport = Deferring()
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01, defer_final=True)
    path = tmp_path / "step.log"
    sender.step_started("plan", path)
    sender.step_ended("plan")
    [stream] = sender.streams
    sender.stop()
    assert sender._send(stream, "late", final=True) is False  # what a thread past its last look would try
    assert sender.close(timeout=0) is False and transport.later == [] and transport.chunks == []


def test_where_the_finish_carries_them_the_closing_threads_final_chunks_are_kept_for_it(tmp_path):
    transport = Deferring()
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01, defer_final=True, carry_final=True)
    quiet = tmp_path / "quiet.log"
    sender.step_started("quiet", quiet)
    sender.step_ended("quiet")
    assert sender.close(timeout=WAIT) is True
    assert sender.thread is None and transport.chunks == [] and transport.later == []  # neither sent nor queued
    assert sender.carried == [{"stream": "quiet", "offset": 0, "text": ""}]


def test_a_final_chunk_the_senders_thread_sends_is_queued_even_where_the_finish_carries_the_rest(tmp_path):
    transport = Deferring()
    sender = LogSender(transport=transport, claim=CLAIM, interval=0.01, defer_final=True, carry_final=True)
    path = tmp_path / "step.log"
    sender.step_started("plan", path)
    path.write_text("output\n")
    sender.output_written()  # the thread starts: it sends this stream to its end, the finish carries none of it
    sender.step_ended("plan")
    assert sender.close(timeout=WAIT) is True
    assert sender.thread is not None and sender.carried == []
    [final] = transport.later
    assert "".join(c["text"] for c in transport.chunks) + final["text"] == "output\n"
