"""The roles' filter plugin over sparkspec.validate, in-process: pip's options written to its config
file are the options pip would read from the same PIP_* environment (read back by pip's own
configuration loader), the env-file quoting escapes exactly systemd's four characters, and what
cannot be carried is refused by name."""

from __future__ import annotations

import importlib.util
import os

import pytest
from ansible.errors import AnsibleFilterError
from pip._internal.configuration import Configuration

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location(
    "sparkspec_validate", ROOT / "roles/sparkspec/filter_plugins/sparkspec_validate.py")
assert _spec and _spec.loader
plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plugin)
_rspec = importlib.util.spec_from_file_location(
    "sparkspec_registry", ROOT / "roles/sparkspec/filter_plugins/sparkspec_registry.py")
assert _rspec and _rspec.loader
registry_plugin = importlib.util.module_from_spec(_rspec)
_rspec.loader.exec_module(registry_plugin)

PIP_ENV = {
    "PIP_INDEX_URL": "https://user:p%40ss;w#rd@pypi.internal/simple",
    "PIP_FIND_LINKS": "/opt/wheels /srv/more wheels",
    "PIP_CERT": "/etc/ssl/certs/corp ca.pem",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_TIMEOUT": 60,
}


def _pip_reads(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dict[str, str]:
    """What pip's configuration loader ends up with, option name -> value, for this
    environment."""
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = Configuration(isolated=False)
    config.load()
    return {key.split(".", 1)[1]: value for key, value in config.items()
            if key.startswith((":env:.", "global."))}


def test_pip_config_file_gives_pip_what_the_environment_gave(tmp_path, monkeypatch):
    # with PIP_CONFIG_FILE set pip skips the user's own pip.conf: compare without one (as root on a
    # Spark whose site configures pip through sparkspec_pip_env)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / ".config"))
    conf = tmp_path / "pip.conf"
    conf.write_text(plugin.pip_config(PIP_ENV))
    from_env = _pip_reads(monkeypatch, {k: str(v) for k, v in PIP_ENV.items()})
    from_file = _pip_reads(monkeypatch, {"PIP_CONFIG_FILE": str(conf)})
    from_file.pop("config-file", None)
    assert from_file == from_env
    assert from_env["index-url"] == PIP_ENV["PIP_INDEX_URL"]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HTTPS_PROXY": "http://u:p@proxy:3128"}, "'HTTPS_PROXY' is not a PIP_\\* option"),
        ({"PIP_INDEX_URL": "https://x\n[global]\ntrusted-host = evil"},
         "PIP_INDEX_URL: the value holds a newline"),
        ({"PIP_TIMEOUT": True}, "PIP_TIMEOUT: bool value"),
        ({"PIP-X": "1"}, "'PIP-X' is not a variable name"),
    ],
    ids=["not-pip", "newline-injection", "bool", "bad-name"],
)
def test_pip_options_pip_could_misread_are_refused(env, expected):
    assert plugin.pip_env_problems(env)
    with pytest.raises(AnsibleFilterError, match=expected):
        plugin.pip_config(env)


@pytest.mark.parametrize(
    ("value", "quoted"),
    [
        ("plain", '"plain"'),
        ('a "b" \\c `d` $e %f #g \'h\'', '"a \\"b\\" \\\\c \\`d\\` \\$e %f #g \'h\'"'),
        (42, '"42"'),
        ("", '""'),
    ],
)
def test_env_quote_escapes_what_systemd_unescapes(value, quoted):
    assert plugin.env_quote(value) == quoted


@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\x00b", None, ["x"], True])
def test_env_quote_refuses_what_an_env_file_cannot_carry(value):
    with pytest.raises(AnsibleFilterError):
        plugin.env_quote(value)


def test_redaction_by_name():
    env = {"HF_TOKEN": "t", "my_api_key": "k", "DB_PASSWORD": "p", "AWS_SECRET_ACCESS_KEY": "s",
           "PLAIN": "v"}
    assert plugin.redact_env(env) == {"HF_TOKEN": "<redacted>", "my_api_key": "<redacted>",
                                      "DB_PASSWORD": "<redacted>",
                                      "AWS_SECRET_ACCESS_KEY": "<redacted>", "PLAIN": "v"}
    assert plugin.redact_env(env, False) == env


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("dir", "../x", "dir: '../x' is not a plain file name"),
        ("dir", "a/b", "dir: 'a/b' is not a plain file name"),
        ("model.repo", "org/../../x", "model.repo: repo id 'org/../../x' is not org/name"),
        ("model.revision", "../../x", "model.revision: revision '../../x' is not a commit id"),
        ("heads.eagle3.repo", "/abs/path",
         "heads.eagle3.repo: repo id '/abs/path' is not org/name"),
    ],
)
def test_profile_names_that_could_leave_their_folder(field, value, expected):
    """Through the resolver's filter (sparkspec_registry.py), as the contract role calls it."""
    profile = {"kind": "plain", "dir": "m", "model": {"repo": "org/m", "revision": "main"},
               "heads": {"eagle3": {"repo": "org/h", "revision": "a" * 40}}}
    contract = {"method": "baseline", "method_switch": "",
                "methods": {"baseline": {"speculative_config": None}},
                "profile": "p", "profiles": {"p": profile}, "stage_profiles": ["p"],
                "models_dir": "/m", "sources_dir": "/m/s", "heads_dir": "/m/h",
                "vllm_venv": "/v"}
    assert registry_plugin.resolve(contract)["problems"] == []
    node = profile
    *path, last = field.split(".")
    for key in path:
        node = node[key]
    node[last] = value
    problems = registry_plugin.resolve(contract)["problems"]
    assert len(problems) == 1 and expected in problems[0], problems
    assert problems[0].startswith("sparkspec_profiles.p.")


def test_unit_names():
    assert plugin.name_problems("sparkspec-vllm", "sparkspec") == []
    assert len(plugin.name_problems("../../etc/x", "root; rm")) == 2

