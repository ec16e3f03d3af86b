"""settings.queue.listener reaches gunicorn and uvicorn: the process count
(which $APIARY_HTTP_WORKERS may override), the ASGI worker class, the
idle timeout, and the request deadline of the listener's HTTP protocol."""

from apiary_site import listener
from workflows.config.schema import ListenerSettings


def test_the_options_come_from_the_config(monkeypatch):
    monkeypatch.delenv("APIARY_HTTP_WORKERS", raising=False)
    monkeypatch.setattr(listener.ApiaryHttp, "request_timeout", listener.ApiaryHttp.request_timeout)
    options = listener.options_for("127.0.0.1:9", ListenerSettings(processes=3, request_timeout=4.0, idle_timeout=75.0))
    assert options["workers"] == 3
    assert options["worker_class"] == "apiary_site.listener.ApiaryWorker"
    assert options["keepalive"] == 75
    assert listener.ApiaryHttp.request_timeout == 4.0
    assert listener.ApiaryWorker.CONFIG_KWARGS["http"] is listener.ApiaryHttp


def test_the_environment_overrides_the_process_count(monkeypatch):
    monkeypatch.setenv("APIARY_HTTP_WORKERS", "5")
    monkeypatch.setattr(listener.ApiaryHttp, "request_timeout", listener.ApiaryHttp.request_timeout)
    assert listener.options_for("127.0.0.1:9", ListenerSettings(processes=2))["workers"] == 5


def test_the_daemon_passes_them_on_the_command_line(monkeypatch):
    seen = {}
    monkeypatch.setattr(listener.subprocess, "Popen", lambda argv, env: seen.update(argv=argv, env=env))
    listener.start("127.0.0.1:9", config_path="/x/apiary.yaml", listener=ListenerSettings(6, 7.5, 8.0))
    argv = seen["argv"]
    assert argv[argv.index("--processes") + 1] == "6"
    assert argv[argv.index("--request-timeout") + 1] == "7.5"
    assert argv[argv.index("--idle-timeout") + 1] == "8.0"
    assert seen["env"]["APIARY_ASGI"] == "1"
