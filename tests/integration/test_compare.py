"""`invoke compare` on the simulated Spark: one run serves every method through the real unit, each
speculative row lossless against baseline; the table's figures equal the server's counter deltas
read here with this file's own parser, every row runs the agent suite too, and bad rows are
refused before any play (docs/design.md, "Module notes")."""

from __future__ import annotations

import json
import re

import pytest

from sparkspec.bench import suites
from tasks.lib import inventory
from tests.conftest import BIN, ROOT, run_cli
from tests.counters import counters_from_text

SIM = "sim01"
PROFILE = "sim-tiny"     # the sim inventory's served profile
MTP_PROFILE = "sim-mtp"  # the sim profile that serves MTP (tests/support, helper B's generator)
ROWS = ("baseline", "ngram", "eagle3", "dflash", f"mtp@{MTP_PROFILE}")
LEVER = "int8_lm_head"   # the sim-tiny profile sets its min_vocab (the tiny vocabulary), off
COLUMNS = ("Method", "Model", "Avg tok/s", "Peak tok/s", "Drafts", "Draft tokens", "Accepted",
           "Acceptance Rate", "Acceptance per position", "Mean acceptance length", "Lossless",
           "Notes")
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total/"


def _sim_vars() -> dict:
    return inventory.load("inventories/sim").host_vars(
        SIM, ("sparkspec_profiles", "sparkspec_stage_profiles"))


def available_rows() -> tuple[list[str], list[str]]:
    """The rows the sim inventory can serve today, and the ones it cannot yet (with why)."""
    values = _sim_vars()
    profiles, staged = values["sparkspec_profiles"], values["sparkspec_stage_profiles"]
    heads = profiles[PROFILE].get("heads", {})
    rows, missing = ["baseline", "ngram"], []
    for head in ("eagle3", "dflash"):
        (rows if head in heads else missing).append(
            head if head in heads else f"{head} (no {head} head on {PROFILE})")
    if MTP_PROFILE in profiles and MTP_PROFILE in staged:
        rows.append(f"mtp@{MTP_PROFILE}")
    else:
        missing.append(f"mtp@{MTP_PROFILE} (no staged profile {MTP_PROFILE})")
    return rows, missing


def table_rows(markdown: str) -> dict[str, dict[str, str]]:
    """Method@profile -> cells of the compare table (the Model cell names the profile)."""
    lines = markdown.splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |", lines[0]
    out = {}
    for line in lines[2:lines.index("")] if "" in lines else lines[2:]:
        cells = dict(zip(COLUMNS, (c.strip() for c in line.strip().strip("|").split(" | ")),
                         strict=False))
        profile = re.search(r"\(profile ([^)]+)\)", cells["Model"])
        assert profile, cells["Model"]
        out[f"{cells['Method']}@{profile.group(1)}"] = cells
    return out


def deltas(name: str) -> dict[str, float]:
    folder = ROOT / "reports/compare" / SIM / "metrics"
    before = counters_from_text((folder / f"{name}.before").read_text())
    after = counters_from_text((folder / f"{name}.after").read_text())
    return {k: after[k] - before.get(k, 0.0) for k in after}


def check_row(name: str, cells: dict[str, str], bench: dict) -> float:
    """The row's figures equal the counter deltas (counts exactly, rates to the table's rounding);
    returns the accepted tokens."""
    d = deltas(name)
    assert bench["total_output_tokens"] == d["vllm:generation_tokens_total"]
    if name.split("@")[0].split("+")[0] == "baseline":   # baseline, or baseline with levers
        assert d.get(DRAFTS, 0.0) == 0.0
        assert [cells[c] for c in COLUMNS[4:11]] == ["n/a"] * 6 + ["reference"], cells
        return 0.0
    drafts, draft_tokens, accepted = d[DRAFTS], d[DRAFT_TOKENS], d[ACCEPTED]
    assert drafts > 0, f"{name}: no drafts in /metrics over the bench"
    assert (int(cells["Drafts"]), int(cells["Draft tokens"]),
            int(cells["Accepted"])) == (drafts, draft_tokens, accepted), cells
    assert float(cells["Acceptance Rate"].rstrip("%")) == pytest.approx(
        100 * accepted / draft_tokens, abs=0.051)
    assert float(cells["Mean acceptance length"]) == pytest.approx(1 + accepted / drafts,
                                                                   abs=0.0051)
    positions = sorted(int(k.removeprefix(PER_POS)) for k in d if k.startswith(PER_POS))
    assert positions == list(range(len(positions))) and positions
    shown = [float(v.rstrip("%")) for v in cells["Acceptance per position"].split(" / ")]
    assert shown == pytest.approx([100 * d[f"{PER_POS}{i}"] / drafts for i in positions], abs=0.051)
    # at least verify_lossless_min_share
    verdict = re.fullmatch(r"(\d+)/(\d+) pass", cells["Lossless"])
    assert verdict, f"{name}: {cells['Lossless']}: {cells['Notes']}"
    # below 100 %: the note names the first divergent token
    if verdict.group(1) != verdict.group(2):
        assert re.search(r"first divergence in \S+ at token \d+: expected id \d+ vs got id \d+",
                         cells["Notes"])
    return accepted


@pytest.mark.sim
@pytest.mark.slow
def test_compare_serves_every_method(provisioned):
    rows, missing = available_rows()
    assert not missing, ("the sim inventory lacks rows of the five-method compare: "
                         f"{', '.join(missing)}")
    # n-gram with the INT8 LM head, lossless against baseline with it (plain n-gram serves and
    # drafts in test_deploy, and is tuned in test_tune)
    rows = [f"ngram+{LEVER}" if row == "ngram" else row for row in rows]
    result = run_cli(f"{BIN}/invoke", "compare", "--host", SIM, "--methods", ",".join(rows),
                     timeout=2400)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr
    table = table_rows((ROOT / "reports" / SIM / "compare.md").read_text())
    expected = {r if "@" in r else f"{r}@{PROFILE}" for r in rows}
    # each profile gets its baseline, and each lever set
    expected |= {f"baseline@{r.split('@')[1]}" for r in rows if "@" in r}
    expected.add(f"baseline+{LEVER}@{PROFILE}")
    assert set(table) == expected, table.keys()
    # baseline's reference is kept per lever set: the lever's row was compared with baseline
    # under it
    assert (f"sparkspec: compare on {SIM}: baseline+{LEVER}@{PROFILE} "
            "(the profile's lossless reference)") in result.stdout
    refs = run_cli(*provisioned.ssh_argv("ls /var/lib/sparkspec/verify")).stdout.split()
    assert {f"reference-{PROFILE}.json", f"reference-{PROFILE}+{LEVER}.json"} <= set(refs), refs
    accepted = {}
    for name, cells in table.items():
        bench = json.loads((ROOT / "reports/compare" / SIM / f"{name}.json").read_text())
        assert cells["Model"] == f"{bench['served_model']['id']} (profile {name.split('@')[1]})"
        # every row ran the agent suite beside the others (verify_suite all): a row per suite
        assert bench["suites"]["agent"]["agent_turns"] == len(suites.load("agent")), name
        assert "agent" in cells["Notes"], cells["Notes"]
        accepted[name.split("@")[0]] = check_row(name, cells, bench)
        if name.split("@")[0].split("+")[0] != "baseline":
            assert f"{name.split('@')[0]} is lossless against baseline" in result.stdout
    assert (ROOT / "reports" / SIM / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # compare restores what ran before it (baseline on the served profile, from provisioning)
    record = json.loads(
        run_cli(*provisioned.ssh_argv("cat /etc/sparkspec/sparkspec-vllm.json")).stdout)
    assert (record["method"], record["profile"],
            record.get("levers")) == ("baseline", PROFILE, None)
    learned = {m: a for m, a in accepted.items() if m in ("mtp", "eagle3", "dflash")}
    assert any(a > 0 for a in learned.values()), f"no distilled head accepted a token: {learned}"


@pytest.mark.parametrize(("methods", "message"), [
    ("baseline,eagle3@sim-hybrid",
     ("--methods eagle3@sim-hybrid: sparkspec_methods.eagle3.head: method eagle3 needs a eagle3 "
      "head, and profile sim-hybrid has none")),
    ("ngram@nope",
     "--methods ngram@nope: sparkspec_profile: 'nope' is not a key of sparkspec_profiles"),
    ("warp", "--methods warp@sim-tiny: sparkspec_method_switch: unknown method 'warp'"),
    ("ngram@", "--methods: 'ngram@' is not METHOD[+LEVER...][@PROFILE]"),
    ("ngram,ngram@sim-tiny", "--methods: ngram@sim-tiny is listed twice"),
    ("ngram+int8_lm_heda", "--methods ngram+int8_lm_heda.int8_lm_heda: unknown lever; did you mean "
                           "int8_lm_head?"),
], ids=["head-the-profile-lacks", "unknown-profile", "unknown-method", "empty-profile", "twice",
        "unknown-lever"])
def test_bad_rows_are_refused_before_any_play(methods, message):
    """Each row is resolved as the play would before the host is touched: one line, exit 2, no
    play run."""
    before = {p: p.stat().st_mtime for p in (ROOT / "reports").rglob("*") if p.is_file()}
    result = run_cli(f"{BIN}/invoke", "compare", "--host", SIM, "--methods", methods, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sparkspec: error: "), result.stderr
    assert message in lines[0]
    assert "PLAY" not in result.stdout
    assert before == {p: p.stat().st_mtime for p in (ROOT / "reports").rglob("*") if p.is_file()}


def test_an_unknown_suite_is_refused_before_any_play():
    result = run_cli(f"{BIN}/invoke", "compare", "--host", SIM, "--methods", "baseline",
                     "--suite", "chat", timeout=120)
    assert result.returncode == 2 and "PLAY" not in result.stdout
    assert result.stderr.strip() == ("sparkspec: error: --suite 'chat' is not one of structured, "
                                     "open, agent, all")


def test_rows_are_planned_per_profile():
    """Baseline first in each profile's group; a profile without a baseline row gets one (its
    reference)."""
    from tasks.compare import plan as compare

    rows = compare.plan(compare.parse("ngram,mtp@p2,baseline,eagle3@p2", "p1"))
    assert [(r.name, r.added) for r in rows] == [("baseline@p1", False), ("ngram@p1", False),
                                                  ("baseline@p2", True), ("mtp@p2", False),
                                                  ("eagle3@p2", False)]


def test_unstaged_profile_is_refused():
    from sparkspec.errors import UserError
    from tasks.compare import plan as compare

    values = _sim_vars()
    contract = {f"sparkspec_{k}": v for k, v in {
        "method": "baseline", "methods": {"baseline": {"speculative_config": None}},
        "profile": PROFILE, "profiles": values["sparkspec_profiles"], "stage_profiles": [PROFILE],
        "models_dir": "/m", "sources_dir": "/m/s", "heads_dir": "/m/h", "vllm_venv": "/v"}.items()}
    with pytest.raises(UserError, match="profile sim-hybrid is not staged on this host"):
        compare.check([compare.Row("baseline", "sim-hybrid")], contract)


@pytest.mark.sim
@pytest.mark.slow
@pytest.mark.parametrize(("expect", "ok"),
                         [(".", True), ("^the-tiny-model-never-says-this$", False)])
def test_known_answers_catch_wrong_output(provisioned, expect, ok):
    """verify asks known-answer prompts: output that does not match fails the play, whatever its
    speed."""
    extra = json.dumps({"verify_known_answers": [{"prompt": "Say something.", "expect": expect}],
                        "verify_lossless": False, "verify_requests": 1, "verify_max_tokens": 8})
    result = run_cli(f"{BIN}/ansible-playbook", "-i", "inventories/sim", "--limit", "sim01",
                     "playbooks/verify.yml", "-e", extra, timeout=900)
    if ok:
        assert result.returncode == 0, result.stdout[-3000:]
    else:
        assert result.returncode != 0
        assert "the model's output is wrong" in result.stdout, result.stdout[-3000:]
