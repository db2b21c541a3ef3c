"""Invoke tasks: the commands a Spark owner types. Thin: the logic lives in the sparkspec package."""

from __future__ import annotations

import getpass
import shlex
import sys
from pathlib import Path

from invoke import Collection, Exit, task

ROOT = Path(__file__).resolve().parents[1]
# invoke puts the checkout on sys.path only while it loads this package; the tasks import the simulator and the
# harnesses (tests.support) when they run, so keep the checkout there.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sparkspec.errors import UserError  # noqa: E402
from tasks import inventory as inventories  # noqa: E402
from tasks import play, remote  # noqa: E402
from tasks import status as host_status  # noqa: E402


def _inventory(c, inventory: str | None) -> str:
    return inventory or c.config.sparkspec.inventory


def _fail(exc: UserError) -> Exit:
    return Exit(f"sparkspec: error: {exc}", code=exc.exit_code)


def _host(c, host: str | None, inventory: str | None) -> inventories.Inventory:
    """The inventory, checked to hold the host: one line naming the fix otherwise."""
    if not host:
        raise Exit("sparkspec: error: --host is required; name a host of the inventory", code=2)
    try:
        inv = inventories.load(_inventory(c, inventory))
        inv.require_host(host)
    except UserError as exc:
        raise _fail(exc) from None
    return inv


def _play(c, playbook: str, host: str | None, inventory: str | None, extra_vars: dict | None = None,
          tags: str = "", skip_tags: str = "", check: bool = False) -> play.PlayResult:
    inv = _host(c, host, inventory)
    assert host is not None
    book = ROOT / "playbooks" / playbook
    if not book.is_file():
        raise Exit(f"sparkspec: error: {book}: playbook not found", code=2)
    # sudo on the host asks for a password unless NOPASSWD or ansible_become_password (vault) is set: the
    # runner answers ansible-playbook's prompt with what getpass read here (it gives the play no terminal)
    password = getpass.getpass("BECOME password: ") if c.config.sparkspec.get("ask_become_pass") else None
    result = play.run_playbook(book, inv.path, host, extra_vars=extra_vars, tags=[t for t in tags.split(",") if t],
                               skip_tags=[t for t in skip_tags.split(",") if t], check=check,
                               become_password=password)
    if result.interrupted:
        raise Exit(f"sparkspec: error: {play.failure_summary(result, host)}", code=130)
    if result.rc != 0:
        raise Exit(f"sparkspec: error: {play.failure_summary(result, host)}", code=2)
    print(f"sparkspec: {playbook} on {host}: changed={result.changed.get(host, 0)}")
    return result


@task(positional=[], auto_shortflags=False, help={"host": "inventory host to provision", "inventory": "inventory folder (default from invoke.yaml)",
            "method": "switch to this method (recorded on the host; later runs keep it)", "tags": "comma-separated phase tags to run",
            "skip-tags": "phase tags to skip", "check": "dry run (Ansible check mode with diff)"})
def provision(c, host=None, inventory=None, method=None, tags="", skip_tags="", check=False):
    """Run the whole pipeline on a host: preflight, tools, checkpoints, vLLM, deploy, verify."""
    if method:
        _method_playbook(c, method, inventory, host)   # an unknown method: one line naming the known ones
    extra = {"sparkspec_method_switch": method} if method else None
    _play(c, "provision.yml", host, inventory, extra, tags, skip_tags, check)


def _methods(c, inventory: str | None, host: str | None) -> list[str]:
    """The methods defined for a host: the contract's built-ins with the inventory's sparkspec_methods and
    sparkspec_methods_extra (sparkspec.registry.defined_methods, as the play's resolver merges them)."""
    from sparkspec import registry

    try:
        values = _host(c, host, inventory).host_vars(host, ("sparkspec_methods", "sparkspec_methods_extra"))
        return sorted(registry.defined_methods(values.get("sparkspec_methods", {}),
                                               values.get("sparkspec_methods_extra")))
    except UserError as exc:
        raise _fail(exc) from None


def _method_playbook(c, method: str | None, inventory: str | None, host: str | None) -> tuple[str, dict]:
    """The playbook and extra vars that switch a host to a method: the thin deploy-<method>.yml of a built-in,
    else deploy.yml with the switch (an inventory's own method, e.g. ngram5 in sparkspec_methods_extra)."""
    known = _methods(c, inventory, host)
    if not method:
        raise Exit(f"sparkspec: error: --method is required; choose one of {', '.join(known)}", code=2)
    if method not in known:
        raise Exit(f"sparkspec: error: unknown method {method!r}; choose one of {', '.join(known)}", code=2)
    if (ROOT / "playbooks" / f"deploy-{method}.yml").is_file():
        return f"deploy-{method}.yml", {}
    return "deploy.yml", {"sparkspec_method_switch": method}


@task(positional=[], auto_shortflags=False, help={"host": "inventory host", "method": "baseline, ngram, mtp, eagle3, dflash or one the inventory defines",
            "inventory": "inventory folder (default from invoke.yaml)", "check": "dry run",
            "skip-tags": "phases to skip, e.g. verify"})
def deploy(c, host=None, method=None, inventory=None, check=False, skip_tags=""):
    """Switch a host to a method: validate, stage, check with vLLM's parser, restart, wait for health, roll back,
    then verify (lossless check against baseline, benchmark, report)."""
    playbook, extra = _method_playbook(c, method, inventory, host)
    _play(c, playbook, host, inventory, extra, skip_tags=skip_tags, check=check)


@task(positional=[], auto_shortflags=False, help={
    "host": "inventory host",
    "methods": "comma-separated rows, METHOD or METHOD@PROFILE (a profile the host stages; default the inventory's), "
               "e.g. baseline,ngram,eagle3,dflash,mtp@sim-mtp; each profile gets a baseline row (its lossless reference)",
    "inventory": "inventory folder (default from invoke.yaml)"})
def compare(c, host=None, methods="baseline,ngram", inventory=None):
    """Deploy each row (method on a profile) in turn: lossless check against baseline on the same profile, bench;
    restore what ran; write one table and plot (reports/<host>/compare.{md,png}) with the /metrics figures."""
    from tasks import compare_plan as plan

    inv = _host(c, host, inventory)
    assert host is not None
    names = tuple(f"sparkspec_{key}" for key in plan.CONTRACT)
    try:
        values = inv.host_vars(host, names)
        rows = plan.plan(plan.parse(methods, values.get("sparkspec_profile", "")))
        plan.check(sorted(rows, key=lambda r: r.added), values)   # the rows asked for first
        now = host_status.host_status(_inventory(c, inventory), host, ask_become_pass=_ask(c))
    except UserError as exc:
        raise _fail(exc) from None
    running = plan.Row(now.method, now.profile or values.get("sparkspec_profile", "")) if now.method else None
    reports = ROOT / "reports" / "compare"
    for row in rows:  # this run's files only: a row that did not run leaves no old result behind
        for old in (reports / host / f"{row.name}.json", reports / host / "lossless" / f"{row.name}.json"):
            old.unlink(missing_ok=True)
    last = running if now.health == 200 else None   # what serves, healthy: its row needs no switch, only verify
    try:
        for row in rows:
            playbook, extra = _method_playbook(c, row.method, inventory, host)
            extra = {**extra, "sparkspec_profile": row.profile, "verify_report_name": row.name,
                     "verify_reports_dir": str(reports), "verify_rerecord_reference": row.method == "baseline"}
            serving = last == plan.Row(row.method, row.profile)
            last = plan.Row(row.method, row.profile)
            print(f"sparkspec: compare on {host}: {row.name}" + (" (the profile's lossless reference)" if row.added
                                                                  else "") + (" (serving: verify only)" if serving
                                                                              else ""))
            _play(c, "verify.yml" if serving else playbook, host, inventory, extra)
    except Exit:  # the table of the rows that ran, then the row's own error
        _compare_table(c, host, reports, [r for r in rows if (reports / host / f"{r.name}.json").is_file()], warn=True)
        raise
    finally:  # a row that fails (e.g. the lossless check) must not leave the host on it
        if running and running != last:
            print(f"sparkspec: restoring {running.name} on {host}")
            playbook, extra = _method_playbook(c, running.method, inventory, host)
            _play(c, playbook, host, inventory, {**extra, "sparkspec_profile": running.profile}, skip_tags="verify")
    _compare_table(c, host, reports, rows)


def _compare_table(c, host: str, reports: Path, rows: list, warn: bool = False) -> None:
    """compare.md and compare.png under reports/<host>/ from the rows' bench results and lossless reports."""
    if not rows:
        return
    out = ROOT / "reports" / host
    inputs = " ".join(shlex.quote(str(reports / host / f"{row.name}.json")) for row in rows)
    lossless = [reports / host / "lossless" / f"{row.name}.json" for row in rows]
    flags = " ".join(shlex.quote(str(p)) for p in lossless if p.is_file())
    done = c.run(f"{shlex.quote(sys.executable)} -m sparkspec.cli report --inputs {inputs}"
                 + (f" --lossless {flags}" if flags else "")
                 + f" --markdown {shlex.quote(str(out / 'compare.md'))} --plot {shlex.quote(str(out / 'compare.png'))}",
                 warn=warn)
    if done is not None and done.ok:
        print((out / "compare.md").read_text())


@task(positional=[], auto_shortflags=False, help={"host": "inventory host", "method": "method to render", "dest": "folder to write the files under",
            "inventory": "inventory folder (default from invoke.yaml)",
            "model-config": "local copy of the model's config.json (checks MTP k)",
            "show-secrets": "write the real API key and secret-named deploy_env values (default: <redacted>)"})
def render(c, host=None, method=None, dest=None, inventory=None, model_config="", show_secrets=False):
    """Write the files the deploy would install for a host and method under DEST, touching no host. Secrets
    (the API key, deploy_env values named *KEY*, *TOKEN*, *SECRET*, *PASSWORD*...) are written as <redacted>
    unless --show-secrets."""
    _method_playbook(c, method, inventory, host)
    if not dest:
        raise Exit("sparkspec: error: --dest is required; name a folder to write the files under", code=2)
    extra = {"sparkspec_method_switch": method, "deploy_render_root": str(Path(dest).resolve()),
             "deploy_render_show_secrets": bool(show_secrets)}
    if model_config:
        extra["deploy_model_config_file"] = str(Path(model_config).resolve())
    _play(c, "render.yml", host, inventory, extra)
    print(f"sparkspec: rendered {method} for {host} under {dest}")


@task(positional=[], auto_shortflags=False, help={"host": "inventory host", "inventory": "inventory folder (default from invoke.yaml)",
            "remove-models": "also delete the checkpoints and heads",
            "keep-token": "keep the hub token file (for a later fetch without the vault)"})
def teardown(c, host=None, inventory=None, remove_models=False, keep_token=False):
    """Stop and remove the vLLM unit on a host, with its secret files: the API key, pip's options and the hub
    token (unless --keep-token). Checkpoints stay unless --remove-models."""
    _play(c, "teardown.yml", host, inventory, {"teardown_remove_models": bool(remove_models),
                                               "teardown_keep_token": bool(keep_token)})


def _ask(c) -> bool:
    return bool(c.config.sparkspec.get("ask_become_pass"))


@task(positional=[], auto_shortflags=False, help={"host": "inventory host (default: every host)", "inventory": "inventory folder",
                                                  "json": "print JSON for scripts instead of the table"})
def status(c, host="all", inventory=None, json=False):
    """A quick look over SSH, no playbook: unit state, method and profile (running, desired, inventory), model,
    /health, memory in use. An unreachable host is one line and exit 1."""
    try:
        names = inventories.load(_inventory(c, inventory)).select(host)
    except UserError as exc:
        raise _fail(exc) from None
    found, errors = [], []
    for name in names:
        try:
            found.append(host_status.host_status(_inventory(c, inventory), name, ask_become_pass=_ask(c)))
        except UserError as exc:
            errors.append(exc)
    if json:
        print(host_status.as_json(found))
    elif found:
        from rich.console import Console

        Console().print(host_status.table(found))
    for error in errors[:-1]:
        print(f"sparkspec: error: {error}", file=sys.stderr)
    if errors:
        raise _fail(errors[-1])


MAX_LOG_LINES = 100_000


@task(positional=[], auto_shortflags=False, help={"host": "inventory host", "inventory": "inventory folder",
                                                  "lines": f"journal lines to show (1-{MAX_LOG_LINES})",
                                                  "follow": "keep printing new lines (Ctrl-C stops)"})
def logs(c, host=None, inventory=None, lines="50", follow=False):
    """The vLLM unit's journal on a host, over SSH (journalctl -u <unit>.service)."""
    count = str(lines).strip()
    if not count.isdigit() or not 1 <= int(count) <= MAX_LOG_LINES:
        raise Exit(f"sparkspec: error: --lines {lines!r} is not a whole number from 1 to {MAX_LOG_LINES}; "
                   f"pass e.g. --lines 50", code=2)
    inv = _host(c, host, inventory)
    assert host is not None
    try:
        target = remote.connect(inv.path, host, ask_become_pass=_ask(c), extra_vars=("sparkspec_unit_name",))
        unit = f"{target.vars['sparkspec_unit_name']}.service"
        try:
            result = target.as_root(f"journalctl -u {shlex.quote(unit)} -n {int(count)} --no-pager"
                                    + (" -f" if follow else ""), hide=False, pty=follow)
        finally:
            target.close()
    except UserError as exc:
        raise _fail(exc) from None
    if result.exited != 0 and not follow:
        raise Exit(f"sparkspec: error: host {host}: journalctl exited {result.exited}; check the unit {unit}",
                   code=1)


@task(positional=[], auto_shortflags=False, help={"host": "inventory host", "inventory": "inventory folder (default from invoke.yaml)"})
def verify(c, host=None, inventory=None):
    """Check what a host serves now (the verify role): lossless against baseline, benchmark, Results Summary table
    and plot under reports/<host>/."""
    _play(c, "verify.yml", host, inventory)


@task(positional=[], auto_shortflags=False, help={"rebuild": "rebuild the image even if one with the same recipe exists"})
def sim_up(c, rebuild=False):
    """Start the simulated Spark (builds its image once): systemd container, sshd on loopback."""
    from tests.support.sim import Sim  # the simulation's code is not needed by the tasks a site runs

    sim = Sim(ROOT)
    try:
        if rebuild:
            sim.down()
            sim.podman("rmi", "-f", sim.image, check=False)
        state = sim.up()
    except UserError as exc:
        raise _fail(exc) from None
    print(f"sim: {sim.container} {state} (image {sim.image}, ssh root@127.0.0.1 -p {sim.ssh_port})")


@task(positional=[], auto_shortflags=False)
def sim_down(c):
    """Stop and remove the simulated Spark container (the cached image stays)."""
    from tests.support.sim import Sim

    try:
        print(f"sim: {Sim(ROOT).down()}")
    except UserError as exc:
        raise _fail(exc) from None


@task(positional=[], auto_shortflags=False, help={"command": "command to run instead of a shell"})
def sim_ssh(c, command=""):
    """Open a shell (or run a command) on the simulated Spark over SSH, with Fabric, as on a real host."""
    try:  # the connection Ansible uses, from the simulated inventory (port and key templated there)
        conn = remote.connect(ROOT / "inventories/sim", c.config.sparkspec.sim_host).open()
    except UserError as exc:
        raise _fail(exc) from None
    try:
        if command:
            raise Exit(code=conn.run(command, warn=True).exited)
        conn.shell()
    finally:
        conn.close()


@task(positional=[], auto_shortflags=False, help={"fix": "let ansible-lint apply its fixes"})
def lint(c, fix=False):
    """ansible-lint (production profile) and yamllint over the whole project."""
    bindir = Path(sys.executable).parent
    c.run(f"{bindir}/yamllint -s .")
    c.run(f"{bindir}/ansible-lint --profile production {'--fix' if fix else ''}".strip())


@task(positional=[], auto_shortflags=False, help={"k": "pytest -k expression", "x": "stop at the first failure",
                                                  "workers": "pytest processes (1: one process, in file order)"})
def test(c, k="", x=False, workers=2):
    """Every test: lint, unit tests, then the simulated-Spark tests (podman, systemd, real vLLM).

    With workers > 1 (pytest-xdist), every test of a file that touches the simulated Spark runs on one worker in
    file order (there is one simulated Spark), and the other files run beside them on the other workers."""
    lint(c)
    bindir = Path(sys.executable).parent
    args = (f" -k {k!r}" if k else "") + (" -x" if x else "")
    if int(workers) > 1:
        args += f" -n {int(workers)}"   # two lanes: tests/conftest.py pytest_xdist_make_scheduler
    # the slowest tests, printed every run, so the cost of the suite stays visible in CI
    c.run(f"{bindir}/pytest --durations=25{args}", pty=False)


@task(positional=[], auto_shortflags=False, help={"workdir": "folder on the disk to measure (needs ~2.5x size-gb free)", "size-gb": "shard bytes",
            "repeats": "best of N"})
def bench_checkpoint(c, workdir="build/bench-checkpoint", size_gb=8.0, repeats=3):
    """assemble vs cp of the same bytes on the same disk (each timed until its output is on disk), and assemble's
    peak RSS."""
    c.run(f"{sys.executable} -m tests.support.ckpt_bench --workdir {shlex.quote(workdir)} --size-gb {size_gb} "
          f"--repeats {repeats}")


@task(positional=[], auto_shortflags=False)
def bench_client(c):
    """The bench client's parse ceiling against a local server sending one token per SSE event."""
    c.run(f"{sys.executable} -m tests.support.bench_ceiling")


@task(positional=[], auto_shortflags=False,
      help={"url": "the server both tools measure", "model": "served model name", "repeats": "interleaved pairs",
            "max-tokens": "tokens per request (both tools ignore EOS)", "concurrency": "requests in flight",
            "suite": "structured|open|all", "vllm-python": "a python with vLLM (its bench serve module)",
            "output": "the JSON result"})
def bench_vs_vllm(c, url="http://127.0.0.1:8000", model="sim-tiny", repeats=20, max_tokens=256, concurrency=1,
                  suite="all", vllm_python=".cache/vllm-venv/bin/python", output="reports/bench-vs-vllm.json"):
    """Side by side with `vllm bench serve` on the same server, prompts and temperature (interleaved repeats)."""
    c.run(f"{sys.executable} -m tests.support.bench_vs_vllm --url {shlex.quote(url)} --model {shlex.quote(model)} "
          f"--repeats {repeats} --max-tokens {max_tokens} --concurrency {concurrency} --suite {shlex.quote(suite)} "
          f"--vllm-python {shlex.quote(vllm_python)} --output {shlex.quote(output)}", pty=True)


@task(positional=[], auto_shortflags=False,
      help={"host": "inventory host (default: the simulated Spark)", "inventory": "inventory folder",
            "to": "method switched to and back from", "back": "method served before and after",
            "repeats": "switches each way and no-op provisions", "output": "raw figures as JSON"})
def bench_switch(c, host="sim01", inventory=None, to="ngram", back="baseline", repeats=3,
                 output="reports/bench-switch.json"):
    """A method switch's cost beyond vLLM's own stop and start (from the unit's journal), and a no-op provision's
    time, each with its spread over the repeats."""
    c.run(f"{sys.executable} -m tests.support.bench_switch --host {shlex.quote(host)} "
          f"--inventory {shlex.quote(_inventory(c, inventory))} --to {shlex.quote(to)} --back {shlex.quote(back)} "
          f"--repeats {int(repeats)} --output {shlex.quote(output)}", pty=False)


bench = Collection("bench")
bench.add_task(bench_checkpoint, "checkpoint")
bench.add_task(bench_client, "client")
bench.add_task(bench_vs_vllm, "vs-vllm")
bench.add_task(bench_switch, "switch")

sim = Collection("sim")
sim.add_task(sim_up, "up")
sim.add_task(sim_down, "down")
sim.add_task(sim_ssh, "ssh")

ns = Collection(provision, deploy, render, teardown, status, verify, logs, compare, lint, test, sim, bench)
ns.configure({"sparkspec": {"inventory": "inventories/sim", "sim_host": "sim01"}})
