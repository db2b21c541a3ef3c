"""tasks.lib.inventory reads inventories through Ansible's inventory API: templated host variables
with the contract's defaults underneath, vault-decrypted values, one-line errors for a missing
inventory or host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparkspec.errors import UserError
from tasks.lib.inventory import CONTRACT_DEFAULTS, load
from tests.conftest import BIN, ROOT


def _inventory(tmp_path: Path, host: dict) -> Path:
    folder = tmp_path / "inv"
    folder.mkdir()
    hosts = {"all": {"children": {"sparks": {"hosts": {"spark01": host}}}}}
    (folder / "hosts.yml").write_text(yaml.safe_dump(hosts))
    return folder


def test_host_vars_are_templated_over_the_contract_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("H3_TEST_PORT", "2345")
    inv = load(_inventory(tmp_path, {
        "ansible_port": "{{ lookup('ansible.builtin.env', 'H3_TEST_PORT') }}",
        "ansible_ssh_private_key_file": "{{ inventory_dir }}/key",
        "sparkspec_method": "{{ 'ng' ~ 'ram' }}",
    }))
    values = inv.host_vars("spark01", ("ansible_port", "ansible_ssh_private_key_file",
                                       "sparkspec_method", "sparkspec_unit_name", "ansible_user"))
    default_unit = yaml.safe_load(CONTRACT_DEFAULTS.read_text())["sparkspec_unit_name"]
    assert values == {"ansible_port": "2345", "ansible_ssh_private_key_file": f"{tmp_path}/inv/key",
                      # ansible_user: set nowhere
                      "sparkspec_method": "ngram", "sparkspec_unit_name": default_unit}
    assert inv.hosts == ["spark01"] and inv.select("all") == ["spark01"]


def test_contract_defaults_that_refer_to_other_variables_are_templated(tmp_path):
    """sparkspec_heads_dir defaults to "{{ sparkspec_models_dir }}/heads": read as a play reads
    it."""
    inv = load(_inventory(tmp_path, {"sparkspec_models_dir": "/srv/models"}))
    values = inv.host_vars("spark01", ("sparkspec_heads_dir", "sparkspec_sources_dir"))
    assert values == {"sparkspec_heads_dir": "/srv/models/heads",
                      "sparkspec_sources_dir": "/srv/models/sources"}


def test_an_inventory_value_wins_over_the_default(tmp_path):
    inv = load(_inventory(tmp_path, {"sparkspec_unit_name": "site-vllm"}))
    assert inv.host_vars("spark01", ("sparkspec_unit_name",)) == {
        "sparkspec_unit_name": "site-vllm"}


def test_missing_inventory_and_host_are_one_line(tmp_path):
    with pytest.raises(UserError,
                       match=r"nope: inventory not found; pass --inventory inventories/<site>"):
        load(tmp_path / "nope")
    inv = load(_inventory(tmp_path, {}))
    with pytest.raises(UserError,
                       match=r"host 'spark99' is not in inventory .* \(hosts: spark01\); "
                             r"add it there"):
        inv.host_vars("spark99", ("ansible_host",))


VAULT_READ = """
import sys
from tasks.lib.inventory import load
print(load(sys.argv[1]).host_vars("spark01", ("ansible_become_password",))\
["ansible_become_password"])
"""


def test_a_vaulted_become_password_is_decrypted(tmp_path):
    secret_file = tmp_path / "vault-pass"
    secret_file.write_text("vault-test-pass\n")
    encrypted = subprocess.run([f"{BIN}/ansible-vault", "encrypt_string",
                                "--vault-password-file", str(secret_file), "sudo-pw-42",
                                "--name", "ansible_become_password"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folder = _inventory(tmp_path, {"ansible_user": "admin"})
    (folder / "host_vars").mkdir()
    (folder / "host_vars/spark01.yml").write_text("---\n" + encrypted)
    env = {**os.environ, "ANSIBLE_VAULT_PASSWORD_FILE": str(secret_file)}
    read = subprocess.run([sys.executable, "-c", VAULT_READ, str(folder)], cwd=ROOT,
                          capture_output=True, text=True, env=env, check=False, timeout=120)
    assert read.stdout.strip() == "sudo-pw-42", read.stderr
    env.pop("ANSIBLE_VAULT_PASSWORD_FILE")
    locked = subprocess.run([sys.executable, "-c", VAULT_READ, str(folder)], cwd=ROOT,
                            capture_output=True, text=True, env=env, check=False, timeout=120)
    assert locked.returncode != 0 and "sudo-pw-42" not in locked.stdout + locked.stderr
    assert ("ansible_become_password of host spark01 is vault-encrypted and cannot be decrypted; "
            "set ANSIBLE_VAULT_PASSWORD_FILE" in locked.stderr), locked.stderr[-2000:]
