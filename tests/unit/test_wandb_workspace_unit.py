"""W&B's workspace settings: `wandb offline` (or `wandb online`, `wandb init`) typed in a directory
writes ./wandb/settings there, and wandb.init reads it from its working directory whatever
WANDB_DIR says (wandb 0.31: its Settings take the working directory as their root before the
environment is read). ftbundle points WANDB_DIR at the run directory; the ranks run in the
job's workdir, so the workdir's settings hold. Rank 0's probe reads them (remote/probe_trackers.py
``wandb_workspace``) and the check judges W&B as it will run: a workdir set offline needs no key
and no server. Real wandb CLI and client; no network."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ftbundle.remote import probe_trackers as probe
from tests.unit.test_check_unit import facts
from tests.unit.test_trackers_unit import BASE, judged

WANDB = Path(sys.executable).parent / "wandb"


def quiet(home: Path) -> dict[str, str]:
    """This environment without W&B's variables, its home ``home`` (no netrc: no key anywhere)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"},
            "HOME": str(home)}


def test_wandb_offline_in_the_workdir_is_read_as_wandb_reads_it(tmp_path, monkeypatch):
    home, work, run_dir = tmp_path / "home", tmp_path / "work", tmp_path / "run"
    for d in (home, work, run_dir):
        d.mkdir()
    made = subprocess.run([str(WANDB), "offline"], capture_output=True, text=True, timeout=120, cwd=work,
                          env=quiet(home))
    assert made.returncode == 0 and (work / "wandb" / "settings").exists(), made.stdout + made.stderr
    # wandb.init in the workdir with WANDB_DIR elsewhere (as ftbundle sets it) and no key: offline, not refused
    init = ("import wandb; r = wandb.init(project='p'); print('OFFLINE', r.offline, r.settings.mode); r.finish()")
    ran = subprocess.run([sys.executable, "-c", init], capture_output=True, text=True, timeout=300, cwd=work,
                         stdin=subprocess.DEVNULL,
                         env={**quiet(home), "WANDB_DIR": str(run_dir), "WANDB_SILENT": "true"})
    assert "OFFLINE True offline" in ran.stdout, ran.stdout + ran.stderr[-2000:]
    assert list(run_dir.glob("wandb/offline-run-*"))  # (its files where WANDB_DIR says)

    workspace = probe.wandb_workspace(str(work))
    assert workspace == {"path": str(work / "wandb" / "settings"), "mode": "offline"}
    monkeypatch.setenv("HOME", str(home))
    seen = probe.wandb_login({}, workspace)
    assert seen["workspace_mode"] == "offline" and seen["machines"] is None
    versions = {**BASE, "wandb": "0.31.0"}
    assert judged(tmp_path, "wandb", [facts("node0", versions=versions, wandb_login=seen)]).ok
    # the environment wins over the settings file, in wandb.init as in the check
    refused = judged(tmp_path, "wandb", [facts("node0", versions=versions, wandb_login=seen)],
                     env={"WANDB_MODE": "online"})
    assert refused.failure == "tracker cannot log" and "has no API key on node0" in refused.details[0]
    # and nothing is knocked on: W&B will not go to a server
    assert probe.servers({"wandb": {"url": None, "mode": None}}, {}, None, workspace) == {}
    # without the workdir's settings: refused as before (no key, online)
    assert judged(tmp_path, "wandb", [facts("node0", versions=versions, wandb_login=probe.wandb_login({}))]).failure


def test_the_workspace_settings_path_and_server_are_wandbs():
    """./.wandb/settings where that folder is (wandb's use_dot_wandb), else ./wandb/settings; a
    base_url there is the server whose netrc entry counts and whose port is knocked on."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assert probe.wandb_workspace(str(work)) == {} and probe.wandb_workspace(None) == {}
        (work / ".wandb").mkdir()
        (work / ".wandb" / "settings").write_text("[default]\nbase_url = https://wandb.invalid\nmode = online\n")
        (work / "wandb").mkdir()
        (work / "wandb" / "settings").write_text("[default]\nmode = offline\n")  # (not read: .wandb is there)
        workspace = probe.wandb_workspace(str(work))
        assert workspace == {"path": str(work / ".wandb" / "settings"), "base_url": "https://wandb.invalid",
                             "mode": "online"}
        assert probe.servers({"wandb": {"url": None, "mode": None}}, {}, None, workspace) == {
            "wandb": {"wandb.invalid:443": "name not resolved"}}
        login = {"netrc": "/root/.netrc", "machines": ["wandb.invalid"], "settings_key": False,
                 "workspace_base_url": "https://wandb.invalid", "workspace_mode": "online"}
        assert judged(work, "wandb", [facts("node0", versions={**BASE, "wandb": "0.31.0"}, wandb_login=login)]).ok
