"""The grafana_dashboards role run for real by ansible-playbook on this machine (Grafana itself is
not installable here): into folders under this checkout, it writes the three dashboards and both
provisioning files, and it refuses, in one line before it writes anything, a dashboard folder whose
parent another user owns (that user could swap the folder for a link and have root write where it
chose). Runs as root, as CI does: the refusal needs a folder given to another owner."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import BIN, ROOT

PLAY = """- name: Grafana dashboards on this machine
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Grafana dashboards
      ansible.builtin.import_role:
        name: grafana_dashboards
"""


@pytest.fixture
def base() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("the role writes root-owned files, "
                    "and the refusal needs a folder of another owner")
    # a chain of root's folders whatever the checkout's parents are (a clone under /tmp sits below
    # 1777)
    folder = Path(tempfile.mkdtemp(prefix="sparkspec-grafana-role-", dir="/var/lib"))
    (folder / "etc-grafana").mkdir(parents=True)
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def run_role(base: Path, dashboards: Path) -> subprocess.CompletedProcess[str]:
    play = base / "play.yml"
    play.write_text(PLAY)
    extra = {"grafana_dashboards_config_dir": str(base / "etc-grafana"),
             "grafana_dashboards_provisioning_dir": str(base / "etc-grafana" / "provisioning"),
             "grafana_dashboards_dir": str(dashboards),
             "grafana_dashboards_service": "sparkspec-no-grafana",
             "ansible_python_interpreter": str(BIN / "python")}
    env = {**os.environ, "ANSIBLE_LIBRARY": str(ROOT / "roles" / "sparkspec" / "library"),
           "ANSIBLE_ROLES_PATH": str(ROOT / "roles")}
    argv = [str(BIN / "ansible-playbook"), "-i", "localhost,", str(play), "-e", json.dumps(extra)]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def test_the_role_writes_its_files_and_refuses_a_folder_another_user_could_redirect(
        base: Path) -> None:
    owned = base / "grafana-home"
    owned.mkdir(mode=0o755)
    os.chown(owned, 65534, 65534)
    refused = run_role(base, owned / "dashboards")
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert (f"grafana_dashboards_dir '{owned / 'dashboards'}': {owned} belongs to nobody "
            "(uid 65534), who could swap what is in it") in out, out[-3000:]
    assert not (base / "etc-grafana" / "provisioning").exists() and list(owned.iterdir()) == []

    done = run_role(base, base / "dashboards")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    names = sorted(p.name for p in (base / "dashboards").iterdir())
    assert names == ["sparkspec-gb10-node.json", "sparkspec-spec-decode.json",
                     "sparkspec-vllm-serving.json"]
    provisioning = base / "etc-grafana" / "provisioning"
    provider = yaml.safe_load(
        (provisioning / "dashboards" / "sparkspec.yaml").read_text())["providers"][0]
    assert provider["options"]["path"] == str(base / "dashboards")
    source = yaml.safe_load(
        (provisioning / "datasources" / "sparkspec.yaml").read_text())["datasources"][0]
    assert source["url"] == "http://127.0.0.1:9090"
    assert all(p.stat().st_uid == 0 and p.stat().st_mode & 0o022 == 0
               for p in provisioning.rglob("*"))
