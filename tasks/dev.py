"""Development tasks: the simulated Spark (sim.*), the measurements (bench.*), lint and test.

The one module of tasks/ that reaches into tests/, and only through tests/support/dev.py (plain
functions), imported when a task runs: `invoke --list` and every host task work in a checkout
without tests/."""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from invoke import Context, Exit, task

from sparkspec.errors import UserError
from tasks.lib.common import ROOT, fail, inventory_of
from tasks.lib.remote import connect

# the development entry point: tests/unit/project/test_import_graph.py allows it, and it alone
DEV_ENTRY = "tests.support.dev"


def support() -> ModuleType:
    """tests/support/dev.py, imported from the checkout (invoke puts only tasks/ on sys.path); one
    line naming the fix in a checkout without tests/."""
    entry = ROOT.joinpath(*DEV_ENTRY.split(".")).with_suffix(".py")
    if not entry.is_file():
        raise Exit(f"sparkspec: error: {entry}: not in this checkout; the sim and bench tasks need "
                   "the whole repository (git clone)", code=2)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(DEV_ENTRY)


def _exit(code: int) -> None:
    if code:
        raise Exit(code=code)


def _say(label: str, call: Callable[[], str]) -> None:
    """One line of what a dev helper did, or its error as the task's one-line exit."""
    try:
        print(f"{label}: {call()}")
    except UserError as exc:
        raise fail(exc) from None


@task(positional=[], auto_shortflags=False,
      help={"rebuild": "rebuild the image even if one with the same recipe exists"})
def sim_up(c, rebuild=False):
    """Start the simulated Spark (builds its image once): systemd container, sshd on loopback."""
    dev = support()
    _say("sim", lambda: dev.sim_up(ROOT, rebuild=bool(rebuild)))


@task(positional=[], auto_shortflags=False)
def sim_down(c):
    """Stop and remove the simulated Spark container (the cached image stays)."""
    dev = support()
    _say("sim", lambda: dev.sim_down(ROOT))


@task(positional=[], auto_shortflags=False)
def sim_pair_up(c):
    """Start the simulated pair for two-node serving: pair-head, pair-worker and their hub.

    The two nodes are on the podman network sparkspec-pair (inventory inventories/sim-pair)."""
    dev = support()
    _say("sim pair", lambda: dev.sim_pair_up(ROOT))


@task(positional=[], auto_shortflags=False)
def sim_pair_down(c):
    """Remove the simulated pair's containers and network, stop its hub (the cached image stays)."""
    dev = support()
    _say("sim pair", lambda: dev.sim_pair_down(ROOT))


@task(positional=[], auto_shortflags=False,
      help={"command": "command to run instead of a shell"})
def sim_ssh(c, command=""):
    """Open a shell (or run a command) on the simulated Spark over SSH, as on a real host.

    The connection is Fabric's."""
    # the connection Ansible uses, from the simulated inventory (port and key templated there)
    try:
        conn = connect(ROOT / "inventories/sim", c.config.sparkspec.sim_host).open()
    except UserError as exc:
        raise fail(exc) from None
    try:
        if command:
            raise Exit(code=conn.run(command, warn=True).exited)
        conn.shell()
    finally:
        conn.close()


@task(positional=[], auto_shortflags=False,
      help={"fix": "let ansible-lint and ruff apply their fixes"})
def lint(c, fix=False):
    """yamllint, ansible-lint (production profile), ruff and mypy over the whole project."""
    bindir = Path(sys.executable).parent
    flag = " --fix" if fix else ""
    c.run(f"{bindir}/yamllint -s .")
    c.run(f"{bindir}/ansible-lint --profile production{flag}")
    # ruff and mypy read their files and rules from pyproject.toml; their time is printed, so CI
    # shows it
    for name, command in (("ruff", f"{bindir}/ruff check{flag}"), ("mypy", f"{bindir}/mypy")):
        start = time.monotonic()
        c.run(command)
        print(f"lint: {name} took {time.monotonic() - start:.1f} s")


@task(positional=[], auto_shortflags=False,
      help={"k": "pytest -k expression", "x": "stop at the first failure",
            "workers": "pytest processes (1: one process, in file order)"})
def test(c, k="", x=False, workers=2):
    """Every test: lint, unit tests, then the simulated-Spark tests (podman, systemd, real vLLM).

    With workers > 1 (pytest-xdist), every test of a file that touches the simulated Spark runs on
    one worker in file order (there is one simulated Spark), the other integration tests on
    another, and each unit test file on whichever worker is free first (tests/conftest.py)."""
    lint(c)
    bindir = Path(sys.executable).parent
    args = (f" -k {k!r}" if k else "") + (" -x" if x else "")
    if int(workers) > 1:
        # the scopes of tests/conftest.py pytest_xdist_make_scheduler, in collection order (sim
        # first)
        args += f" -n {int(workers)} --no-loadscope-reorder"
    # the slowest tests, printed every run, so the cost of the suite stays visible in CI; every
    # test's time in reports/pytest.xml
    c.run(f"{bindir}/pytest --durations=25 --junitxml=reports/pytest.xml{args}", pty=False)


@task(positional=[], auto_shortflags=False,
      help={"workdir": "folder on the disk to measure (needs ~2.5x size-gb free)",
            "size-gb": "shard bytes", "repeats": "best of N"})
def bench_checkpoint(c, workdir="build/bench-checkpoint", size_gb=8.0, repeats=3):
    """assemble vs cp of the same bytes on the same disk, and assemble's peak RSS.

    Each is timed until its output is on disk."""
    _exit(support().bench_checkpoint(ROOT, workdir, float(size_gb), int(repeats)))


@task(positional=[], auto_shortflags=False)
def bench_client(c):
    """The bench client's parse ceiling against a local server sending one token per SSE event."""
    _exit(support().bench_client())


@task(positional=[], auto_shortflags=False,
      help={"url": "the server both tools measure", "model": "served model name",
            "repeats": "interleaved pairs",
            "max-tokens": "tokens per request (both tools ignore EOS)",
            "concurrency": "requests in flight",
            "suite": "structured|open|all (prompts only: vllm bench serve has no conversations)",
            "vllm-python": "a python with vLLM (its bench serve module)",
            "output": "the JSON result"})
def bench_vs_vllm(c, url="http://127.0.0.1:8000", model="sim-tiny", repeats=20, max_tokens=256,
                  concurrency=1, suite="all", vllm_python=".cache/vllm-venv/bin/python",
                  output="reports/bench-vs-vllm.json"):
    """Side by side with `vllm bench serve` on the same server, prompts and temperature.

    The repeats are interleaved."""
    _exit(support().bench_vs_vllm(url, model, repeats, max_tokens, concurrency, suite, vllm_python,
                                  output))


@task(positional=[], auto_shortflags=False,
      help={"host": "inventory host (default: the simulated Spark)",
            "inventory": "inventory folder",
            "to": "method switched to and back from", "back": "method served before and after",
            "repeats": "switches each way and no-op provisions", "output": "raw figures as JSON"})
def bench_switch(c: Context, host="sim01", inventory=None, to="ngram", back="baseline", repeats=3,
                 output="reports/bench-switch.json"):
    """A method switch's cost beyond vLLM's own stop and start, and a no-op provision's time.

    The switch's cost comes from the unit's journal; each figure has its spread over the
    repeats."""
    _exit(support().bench_switch(host, inventory_of(c, inventory), to, back, int(repeats), output))


@task(positional=[], auto_shortflags=False,
      help={"host": "inventory host (default: the simulated Spark)",
            "inventory": "inventory folder",
            "repeats": "cold and warm start pairs",
            "compile": "serve without --enforce-eager for the bench",
            "output": "raw figures as JSON"})
def bench_cold_start(c: Context, host="sim01", inventory=None, repeats=3, compile=False,
                     output="reports/bench-cold-start.json"):
    """A start with the compile cache emptied against a restart that finds it, with spread.

    The cache is the command line's; emptying it makes the host compile once more."""
    _exit(support().bench_cold_start(host, inventory_of(c, inventory), int(repeats), compile,
                                     output))
