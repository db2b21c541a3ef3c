"""`invoke tune` on the simulated Spark: n-gram tuned on the owner's prompts through the normal
deploy and verify path, its prediction and survival rates checked against the server's own counters
(tests/counters.py), what served before put back (also after a Ctrl-C), bad input refused in one
line before any play."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, ROOT, run_cli
from tests.counters import counters_from_text

SIM = "sim01"
PROMPTS = ROOT / "tests" / "data" / "tune-repetitive.jsonl"
WORKLOAD = ("--prompts", str(PROMPTS), "--max-tokens", "48")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total/"


def _status() -> dict:
    result = run_cli(f"{BIN}/invoke", "status", "--host", SIM, "--json", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)[0]


def _record(provisioned) -> dict:
    return json.loads(
        run_cli(*provisioned.ssh_argv("cat /etc/sparkspec/sparkspec-vllm.json")).stdout)


def _deltas(name: str) -> dict[str, float]:
    folder = ROOT / "reports" / "tune" / SIM / "metrics"
    before = counters_from_text((folder / f"{name}.before").read_text())
    after = counters_from_text((folder / f"{name}.after").read_text())
    return {k: after[k] - before.get(k, 0.0) for k in after}


@pytest.fixture
def inventory_copy():
    """The sim inventory copied at its depth (its paths are relative to its folder), for --apply to
    edit."""
    copy = ROOT / ".cache" / f"tune-apply-{os.getpid()}"   # two levels down, as inventories/sim
    shutil.copytree(ROOT / "inventories" / "sim", copy)
    try:
        yield copy
    finally:
        shutil.rmtree(copy)


@pytest.mark.sim
@pytest.mark.slow
def test_tune_ngram_predicts_from_one_run(provisioned, inventory_copy):
    before = _record(provisioned)
    hosts = (inventory_copy / "hosts.yml").read_text()
    # the built-in suites, the agent suite among them: a verdict per suite
    result = run_cli(f"{BIN}/invoke", "tune", "--host", SIM, "--method", "ngram", "-k", "1,3",
                     "--suite", "all", "--max-tokens", "48", "--apply", "--inventory",
                     str(inventory_copy), timeout=1800)
    # --apply writes the best k only where the measurements back it (exit 1 and one line otherwise)
    applied = result.returncode == 0
    assert applied or (
        result.returncode == 1 and "--apply: " in result.stderr
        and "nothing written" in result.stderr), result.stdout[-6000:] + result.stderr
    doc = json.loads((ROOT / "reports" / SIM / "tune" / "ngram.json").read_text())
    assert doc["format"] == "sparkspec-tune/1" and doc["method"] == "ngram"
    whole = next(c for c in doc["cases"] if c["suite"] == "all prompts" and c["concurrency"] == 1)
    assert sorted(whole["measured"]) == ["1", "3"] and whole["k_max"] == 3
    agent = next(c for c in doc["cases"] if c["suite"] == "agent" and c["concurrency"] == 1)
    assert sorted(agent["measured"]) == ["1", "3"] and agent["verdict"]
    tuning = whole["tuning"]
    assert tuning is not None, whole["verdict"]
    # the survival rates come from the server's own counters over the k = 3 bench
    d = _deltas("ngram-k3-c1")
    drafts = d["vllm:spec_decode_num_drafts_total"]
    assert drafts > 0 and tuning["survival"]["num_drafts"] == drafts
    rates = [r["estimate"] for r in tuning["survival"]["rates"]]
    assert rates == pytest.approx([d.get(f"{PER_POS}{i}", 0.0) / drafts for i in range(3)],
                                  abs=1e-9)
    generated, accepted = (d["vllm:generation_tokens_total"],
                           d["vllm:spec_decode_num_accepted_tokens_total"])
    assert tuning["survival"]["steps"] == generated - accepted
    assert rates[0] > 0.05, f"n-gram accepted almost nothing on repetitive prompts: {rates}"
    # every k up to k_max is predicted, and the measured k = 1 is set against its prediction
    assert [p["k"] for p in tuning["predictions"]] == [1, 2, 3]
    assert {e["k"] for e in tuning["errors"]} == {1, 3}
    assert tuning["best_k"] in (1, 2, 3) and whole["best_measured"] in (1, 3)
    md = (ROOT / "reports" / SIM / "tune-ngram.md").read_text()
    assert md.startswith("# sparkspec tune: ngram on sim01") and whole["verdict"] in md
    assert (ROOT / "reports" / SIM / "tune-ngram.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # nothing beside the host's bench results, which the verify role reads as one
    # (reports/<host>/*.json)
    assert not list((ROOT / "reports" / SIM).glob("tune*.json"))
    print(f"tune ngram on sim01: {whole['verdict']}; errors "
          + ", ".join(f"k{e['k']} {e['error_pct']:+.1f} %" for e in tuning["errors"])
          + f"; --apply {'wrote' if applied else 'refused: ' + result.stderr.strip()}")
    # what served before is back, at its own k, healthy
    after = _record(provisioned)
    assert (after["method"], after["profile"]) == (before["method"], before["profile"])
    assert after.get("num_speculative_tokens") == before.get("num_speculative_tokens")
    assert _status()["health"] == 200
    # the key lands where Ansible reads it for sim01 (its hosts.yml entry), the file's comments kept
    from tasks.lib import inventory

    now = (inventory_copy / "hosts.yml").read_text()
    if applied:
        got = inventory.load(inventory_copy).host_vars(SIM,
                                                       ("sparkspec_num_speculative_tokens",))
        assert got["sparkspec_num_speculative_tokens"] == {"ngram": tuning["best_k"]}
        assert ([ln for ln in hosts.splitlines() if "#" in ln]
                == [ln for ln in now.splitlines() if "#" in ln])
        assert "+          sparkspec_num_speculative_tokens:" in result.stdout
    else:
        assert now == hosts


@pytest.mark.sim
@pytest.mark.slow
def test_interrupted_tune_restores_what_served(provisioned):
    """Ctrl-C while a k is being deployed (the unit loading, the deploy's lock held): the sweep
    stops, the restore releases the lock the interrupted play left (the same command's) and the
    method that served before comes back; no lock holder is left on the host."""
    before = _record(provisioned)
    proc = subprocess.Popen([f"{BIN}/invoke", "tune", "--host", SIM, "--method", "ngram",
                             "--k-max", "2", *WORKLOAD, "--requests", "1"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            env={**os.environ,
                                 "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    seen: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 900
    switching = False
    for line in proc.stdout:
        seen.append(line)
        switching = switching or "tune: ngram k=2" in line
        # under the lock, the new unit loading
        if switching and "TASK [deploy : Wait for /health" in line:
            # a terminal's Ctrl-C reaches the whole foreground group
            os.killpg(proc.pid, signal.SIGINT)
            break
        assert time.monotonic() < deadline, "".join(seen[-50:])
    try:
        out, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired as exc:   # leave no tune behind for the tests after this one
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        tail = ((exc.output or b"").decode(errors="replace")[-4000:]
                if isinstance(exc.output, bytes) else (exc.output or "")[-4000:])
        pytest.fail(f"tune still running 900 s after Ctrl-C; its last output:\n{tail}")
    text = "".join(seen) + out
    assert proc.returncode != 0, text[-4000:]
    assert f"tune: restoring {before['method']}" in text, text[-4000:]
    # Where Ansible stopped at once, the lock was left held and the restore releases it
    # ("changed"); where the SIGINT failed the running task first, the play's own `always`
    # released it ("skipping"). Both were seen.
    released = text.split("TASK [deploy : Release the deploy lock "
                          "this command's interrupted play left]")
    after = released[-1].split("\n", 1)[-1].split()[:2]
    assert len(released) >= 2 and after in (["changed:", "[sim01]"],
                                            ["skipping:", "[sim01]"]), text[-4000:]
    assert "could not take the deploy lock" not in text, text[-4000:]
    held = run_cli(*provisioned.ssh_argv(
        "systemctl is-active sparkspec-deploy-lock-sparkspec-vllm")).stdout
    assert held.strip() in ("inactive", "unknown"), held
    # The tune deletes its rows' files first, so a k=2 file is this run's. Ansible may finish the
    # task the SIGINT reached and then the row; the tune then reports the rows that ran (baseline
    # and k_max) and stops. Either way the files and what the tune said agree.
    k2_ran = (ROOT / "reports" / "tune" / SIM / "ngram-k2-c1.json").exists()
    assert k2_ran == ("tune report (the rows that ran)" in text), text[-4000:]
    status = _status()
    assert (status["method"], status["profile"],
            status["health"]) == (before["method"], before["profile"], 200), status
    assert status["k"] == before.get("num_speculative_tokens")


def _refused(*args: str) -> str:
    reports = {p: p.stat().st_mtime for p in (ROOT / "reports").rglob("*") if p.is_file()}
    result = run_cli(f"{BIN}/invoke", "tune", "--host", SIM, *args, timeout=120)
    assert result.returncode != 0, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparkspec: error: "), result.stderr
    assert "PLAY" not in result.stdout and "Traceback" not in result.stderr
    assert reports == {p: p.stat().st_mtime for p in (ROOT / "reports").rglob("*") if p.is_file()}
    return lines[0]


@pytest.mark.parametrize(("args", "message"), [
    (("--method", "ngram", "-k", ","), "-k: nothing given"),
    (("--method", "ngram", "-k", "0,2"), "-k: 0 is outside 1..64"),
    (("--method", "ngram", "-k=-3"), "-k: '-3' is not a k"),
    (("--method", "ngram", "-k", "65"), "-k: 65 is outside 1..64"),
    (("--method", "ngram", "-k", "2", "--k-max", "4"), "-k and --k-max both given"),
    (("--method", "baseline"), "--method baseline: drafts nothing"),
    (("--method", "warp"), "unknown method 'warp'"),
    (("--method", "ngram", "--concurrency", "0"), "--concurrency: 0 is outside 1..256"),
    (("--method", "ngram", "--suite", "chat"), "--suite: 'chat' is not one of"),
    (("--method", "ngram", "--k-max", "two"), "--k-max: 'two' is not a whole number in 1..64"),
    (("--method", "ngram", "--temperature", "warm"), "--temperature: 'warm' is not a number"),
], ids=["empty-k", "zero-k", "negative-k", "k-above-64", "k-and-kmax", "no-draft", "unknown",
        "zero-concurrency", "bad-suite", "word-k-max", "word-temperature"])
def test_bad_input_is_refused_before_any_play(args, message):
    line = _refused(*args)
    assert message in line, line


@pytest.mark.parametrize(("content", "message"), [
    (b"", "suite has no prompts"),
    (b'{"prompt": "a"}\nnot json\n', ":2: not JSON"),
    (b'{"text": "no prompt key"}\n', '"prompt"'),
    # an agent conversation whose second turn is a string, not a chat message
    (b'{"id": "c", "turns": [{"role": "user", "content": "hi"}, "the answer"]}\n',
     "mine.jsonl:1: turns[1] is str"),
    # a tool whose parameters are not JSON Schema ("type" names no JSON type)
    (b'{"id": "c", "tools": [{"type": "function", "function": {"name": "f", "parameters": '
     b'{"type": "objekt"}}}], "turns": [{"role": "user", "content": "hi"}, '
     b'{"role": "assistant", "content": "ok"}]}\n',
     "mine.jsonl:1: tools[0].function.parameters is not valid JSON Schema"),
], ids=["empty", "not-jsonl", "no-prompt", "turn-not-an-object", "tool-not-json-schema"])
def test_bad_prompts_file_is_refused(tmp_path: Path, content: bytes, message: str):
    path = tmp_path / "mine.jsonl"
    path.write_bytes(content)
    line = _refused("--method", "ngram", "--prompts", str(path))
    assert message in line, line


def test_huge_prompts_file_is_refused(tmp_path: Path):
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as f:
        f.truncate((16 << 20) + 1)   # sparse: 16 MiB + 1 byte, over the suites' bound
    line = _refused("--method", "ngram", "--prompts", str(path))
    assert "more than the 16777216 a suite file can be" in line, line


@pytest.mark.sim
def test_dflash_k_above_its_block_is_refused(provisioned):
    """DFlash drafts one block: k above the head's block_size - 1 (read from its config.json on the
    host)."""
    head = json.loads(run_cli(*provisioned.ssh_argv(
        "cat /opt/sparkspec/models/heads/sparkspec--sim-tiny-DFlash/config.json")).stdout)
    block = head["dflash_config"]["block_size"]
    line = _refused("--method", "dflash", "-k", str(block))
    assert f"above what this method allows ({block - 1}" in line and "block_size" in line, line
