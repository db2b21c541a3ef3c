"""Host operations: provision, deploy, render, teardown and verify, each one playbook run through
ansible-runner (tasks.lib.play), on one host of the inventory."""

from __future__ import annotations

import getpass
import os
from pathlib import Path
from typing import Any

from invoke import Context, Exit, task

from sparkspec import registry
from sparkspec.errors import UserError
from sparkspec.outputs import check_disjoint
from tasks.lib.common import ROOT, fail, require_host
from tasks.lib.play import PlayResult, failure_summary, run_playbook

INVENTORY_HELP = "inventory folder (default from invoke.yaml)"


def run_play(c: Context, playbook: str, host: str | None, inventory: str | None,
             extra_vars: dict[str, Any] | None = None, tags: str = "", skip_tags: str = "",
             check: bool = False) -> PlayResult:
    """One playbook on the hosts --host names (a host, a cluster's group or a comma-separated list:
    a cluster runs as one play); a failure ends the task with the play's one-line summary."""
    inv = require_host(c, host, inventory, many=True)
    assert host is not None
    hosts = inv.hosts_of(host)
    book = ROOT / "playbooks" / playbook
    if not book.is_file():
        raise Exit(f"sparkspec: error: {book}: playbook not found", code=2)
    # sudo on the host asks for a password unless NOPASSWD or ansible_become_password (vault) is
    # set: the runner answers ansible-playbook's prompt with what getpass read here (it gives the
    # play no terminal)
    password = (getpass.getpass("BECOME password: ") if c.config.sparkspec.get("ask_become_pass")
                else None)
    result = run_playbook(book, inv.path, ",".join(hosts), extra_vars=extra_vars,
                          tags=[t for t in tags.split(",") if t],
                          skip_tags=[t for t in skip_tags.split(",") if t], check=check,
                          become_password=password)
    # the host that failed first (its own line: in a cluster the others stop naming it), else the
    # first
    first = [f.host for f in result.failures if f.host in hosts]
    failed = next((h for h in hosts if h in result.unreachable), first[0] if first else hosts[0])
    if result.interrupted:
        raise Exit(f"sparkspec: error: {failure_summary(result, failed)}", code=130)
    if result.rc != 0:
        raise Exit(f"sparkspec: error: {failure_summary(result, failed)}", code=2)
    for name in hosts:
        print(f"sparkspec: {playbook} on {name}: changed={result.changed.get(name, 0)}")
    return result


def defined_methods(c: Context, inventory: str | None, host: str | None) -> list[str]:
    """The methods defined for a host: the built-ins with the inventory's sparkspec_methods on top
    (sparkspec.registry.defined_methods, as the play's resolver merges them)."""
    try:
        inv = require_host(c, host, inventory, many=True)
        assert host is not None   # require_host refused a missing --host
        values = inv.host_vars(inv.hosts_of(host)[0], ("sparkspec_methods",))
        return sorted(registry.defined_methods(values.get("sparkspec_methods")))
    except UserError as exc:
        raise fail(exc) from None


def method_playbook(c: Context, method: str | None, inventory: str | None,
                    host: str | None) -> tuple[str, dict[str, Any]]:
    """The playbook and extra vars that switch a host to a method: the thin deploy-<method>.yml of a
    built-in, else deploy.yml with the switch (an inventory's own method, e.g. ngram5 in
    sparkspec_methods)."""
    known = defined_methods(c, inventory, host)
    if not method:
        raise Exit(f"sparkspec: error: --method is required; choose one of {', '.join(known)}",
                   code=2)
    if method not in known:
        raise Exit(f"sparkspec: error: unknown method {method!r}; choose one of "
                   f"{', '.join(known)}", code=2)
    if (ROOT / "playbooks" / f"deploy-{method}.yml").is_file():
        return f"deploy-{method}.yml", {}
    return "deploy.yml", {"sparkspec_method_switch": method}


@task(positional=[], auto_shortflags=False, help={
    "host": "inventory host to provision", "inventory": INVENTORY_HELP,
    "method": "switch to this method (recorded on the host; later runs keep it)",
    "tags": "comma-separated phase tags to run", "skip-tags": "phase tags to skip",
    "check": "dry run (Ansible check mode with diff)"})
def provision(c, host=None, inventory=None, method=None, tags="", skip_tags="", check=False):
    """Run the whole pipeline on a host: preflight, tools, checkpoints, vLLM, deploy, verify."""
    if method:
        # an unknown method: one line naming the known ones
        method_playbook(c, method, inventory, host)
    extra = {"sparkspec_method_switch": method} if method else None
    run_play(c, "provision.yml", host, inventory, extra, tags, skip_tags, check)


@task(positional=[], auto_shortflags=False, help={
    "host": "inventory host",
    "method": "baseline, ngram, mtp, eagle3, dflash or one the inventory defines",
    "inventory": INVENTORY_HELP, "check": "dry run", "skip-tags": "phases to skip, e.g. verify"})
def deploy(c, host=None, method=None, inventory=None, check=False, skip_tags=""):
    """Switch a host to a method, with its checks, roll back and verify.

    In order: validate, stage, check with vLLM's parser, restart, wait for health, roll back, then
    verify (lossless check against baseline, benchmark, report)."""
    playbook, extra = method_playbook(c, method, inventory, host)
    run_play(c, playbook, host, inventory, extra, skip_tags=skip_tags, check=check)


@task(positional=[], auto_shortflags=False, help={
    "host": "inventory host", "method": "method to render",
    "dest": "folder to write the files under",
    "inventory": INVENTORY_HELP,
    "model-config": "local copy of the model's config.json (checks MTP k)",
    "show-secrets": "write the real API key and secret-named deploy_env values "
                    "(default: <redacted>)"})
def render(c, host=None, method=None, dest=None, inventory=None, model_config="",
           show_secrets=False):
    """Write the files the deploy would install for a host and method under DEST, touching no host.

    DEST must be new, empty or an earlier render's (its .sparkspec-render marker), with no link in
    or under it. Secrets (the API key, deploy_env values named *KEY*, *TOKEN*, *SECRET*,
    *PASSWORD*...) are written as <redacted> unless --show-secrets."""
    method_playbook(c, method, inventory, host)
    if not dest:
        raise Exit("sparkspec: error: --dest is required; name a folder to write the files under",
                   code=2)
    inv = require_host(c, host, inventory)
    folder = inv.path if inv.path.is_dir() else inv.path.parent
    # the play reads the inventory folder: rendered files (a .json among them) must not land in it
    try:
        check_disjoint(os.path.abspath(dest), {"--inventory": folder}, "--dest")
    except UserError as exc:
        raise fail(exc) from None
    # absolute but not resolved: a --dest that is a link reaches the role's check as the link, and
    # is refused
    extra = {"sparkspec_method_switch": method, "deploy_render_root": os.path.abspath(dest),
             "deploy_render_show_secrets": bool(show_secrets)}
    if model_config:
        extra["deploy_model_config_file"] = str(Path(model_config).resolve())
    run_play(c, "render.yml", host, inventory, extra)
    print(f"sparkspec: rendered {method} for {host} under {dest}")


@task(positional=[], auto_shortflags=False, help={
    "host": "inventory host", "inventory": INVENTORY_HELP,
    "remove-models": "also delete the checkpoints and heads",
    "keep-token": "keep the hub token file (for a later fetch without the vault)"})
def teardown(c, host=None, inventory=None, remove_models=False, keep_token=False):
    """Stop and remove the vLLM unit on a host, with its secret files.

    The secret files are the API key, pip's options and the hub token (unless --keep-token).
    Checkpoints stay unless --remove-models."""
    run_play(c, "teardown.yml", host, inventory, {"teardown_remove_models": bool(remove_models),
                                                  "teardown_keep_token": bool(keep_token)})


@task(positional=[], auto_shortflags=False,
      help={"host": "inventory host", "inventory": INVENTORY_HELP})
def verify(c, host=None, inventory=None):
    """Check what a host serves now (the verify role): lossless check, benchmark, Results Summary.

    The lossless check is against baseline; the Results Summary table and plot go under
    reports/<host>/."""
    run_play(c, "verify.yml", host, inventory)


@task(positional=[], auto_shortflags=False, help={
    "host": "inventory host", "inventory": INVENTORY_HELP,
    "grafana": "also install sparkspec's Grafana dashboards (the host must run Grafana)",
    "check": "dry run (Ansible check mode with diff)"})
def monitoring(c, host=None, inventory=None, grafana=False, check=False):
    """Install Prometheus, the node exporter and Alertmanager on a host, scraping its vLLM.

    They come from the distribution's packages, with sparkspec's recording and alert rules
    (docs/monitoring.md), bound to 127.0.0.1 unless monitoring_listen_address says otherwise."""
    run_play(c, "monitoring.yml", host, inventory, {"grafana_dashboards_enabled": bool(grafana)},
             check=check)
