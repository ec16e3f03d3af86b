"""Admin sessions are signed with a random per-state-directory key, the same in every process."""

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRINT_KEY = "from django.conf import settings; print(settings.SECRET_KEY)"


def _key(config: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APIARY_", "DJANGO_"))}
    env |= {"APIARY_CONFIG": str(config), "DJANGO_SETTINGS_MODULE": "apiary_site.settings"}
    return subprocess.Popen([sys.executable, "-c", PRINT_KEY], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def test_processes_racing_for_the_key_agree_and_it_is_private(tmp_path):
    (tmp_path / ".apiary").mkdir()
    config = tmp_path / "apiary.yaml"
    racers = [_key(config) for _ in range(4)]
    keys = {proc.communicate(timeout=60)[0].strip() for proc in racers}
    stored = (tmp_path / ".apiary" / "secret_key").read_text().strip()
    assert keys == {stored} and len(stored) >= 50
    assert stat.S_IMODE((tmp_path / ".apiary" / "secret_key").stat().st_mode) == 0o600
    assert sorted(p.name for p in (tmp_path / ".apiary").iterdir()) == ["secret_key"]  # no drafts left


def test_two_projects_never_share_a_key(tmp_path):
    keys = set()
    for name in ("a", "b"):
        (tmp_path / name / ".apiary").mkdir(parents=True)
        keys.add(_key(tmp_path / name / "apiary.yaml").communicate(timeout=60)[0].strip())
    assert len(keys) == 2
