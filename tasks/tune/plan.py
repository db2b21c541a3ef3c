"""`invoke tune`'s plan: which k to deploy, at which concurrency levels, on which workload, each
input checked in one line before anything changes (pure, no I/O beyond reading the owner's prompts
file).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkspec import registry
from sparkspec.bench import suites
from sparkspec.errors import UserError
from sparkspec.registry.data import MAX_SPECULATIVE_TOKENS
from sparkspec.registry.levers import exact_block

MAX_CONCURRENCY = 256   # the bench's own bound (sparkspec.cli.bench): vLLM's default max_num_seqs
MAX_REQUESTS = 100_000  # per suite, the bench's bound
MAX_TOKENS = 262_144    # Qwen3.5's context, the bench's bound
SUITES = (*suites.BUILTIN, "all")


@dataclass(frozen=True)
class Workload:
    """What every row measures: the owner's sampling settings, since acceptance depends on them."""

    suite: str = "all"             # a built-in suite, or "prompts" when prompts is set
    prompts: str = ""              # the owner's JSONL file (absolute), copied to the host by verify
    requests: int | None = None    # per suite; None: each prompt once
    temperature: float = 0.0
    thinking: bool = False
    max_tokens: int | None = None  # None: the verify role's verify_max_tokens


@dataclass(frozen=True)
class Row:
    method: str
    k: int              # 0: the baseline row
    concurrency: int
    deploy: bool        # the first level of this k deploys it; the others verify what serves

    @property
    def name(self) -> str:
        """The row's results name (reports/tune/<head>/<name>.json): letters, digits and '-'
        only."""
        return f"{self.method if self.k else 'baseline'}-k{self.k}-c{self.concurrency}"


def _integers(text: str, flag: str, low: int, high: int, what: str) -> list[int]:
    out: list[int] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        first, dash, last = part.partition("-")
        if not (first.isascii() and first.isdigit()) or (
                dash and not (last.isascii() and last.isdigit())):
            raise UserError(f"{flag}: {part!r} is not {what} (an integer, or a range such as 1-6); "
                            f"e.g. {flag} 1,2,4")
        span = range(int(first), int(last if dash else first) + 1)
        if not span:
            raise UserError(f"{flag}: {part!r} is an empty range; give low-high with low <= high")
        for value in span:
            if not low <= value <= high:
                raise UserError(f"{flag}: {value} is outside {low}..{high}; give {what} in that "
                                "range")
            if value in out:
                raise UserError(f"{flag}: {value} is listed twice; give each once")
            out.append(value)
    if not out:
        raise UserError(f"{flag}: nothing given; e.g. {flag} 1,2,4")
    return sorted(out)


def whole(value: int | str, flag: str, high: int) -> int:
    """An option's whole number in 0..high (0: not given), from invoke's string or an int; one line
    else."""
    text = str(value).strip()
    if isinstance(value, bool) \
            or not (isinstance(value, int) or (text.isascii() and text.isdigit())) \
            or not 0 <= int(text) <= high:
        raise UserError(f"{flag}: {str(value)[:40]!r} is not a whole number in 1..{high}")
    return int(text)


def parse_ks(k: str, k_max: int | str, current: int, limit: int) -> list[int]:
    """The k to measure: ``-k`` (a list), else ``--k-max`` alone (the one run the prediction needs),
    else the method's current k. ``limit``: the most the method allows (64; DFlash: its block size -
    1)."""
    k_max = whole(k_max or 0, "--k-max", MAX_SPECULATIVE_TOKENS)
    if k and k_max:
        raise UserError("-k and --k-max both given; give the list to measure (-k 1,2,4) or the one "
                        "k to predict from (--k-max 4)")
    if k:
        ks = _integers(k, "-k", 1, MAX_SPECULATIVE_TOKENS, "a k")
    else:
        top = k_max or current
        if type(top) is not int or not 1 <= top <= MAX_SPECULATIVE_TOKENS:
            raise UserError(f"--k-max: {top!r} is not an integer in 1..{MAX_SPECULATIVE_TOKENS}; "
                            "e.g. --k-max 4")
        ks = [top]
    if ks[-1] > limit:
        raise UserError(f"-k: {ks[-1]} is above what this method allows ({limit}: the DFlash "
                        f"head's block_size - 1, from its config.json); give k <= {limit}")
    return ks


def parse_levels(text: str) -> list[int]:
    """``--concurrency``: the levels to measure each k at (the first is the deploy's own verify)."""
    return _integers(text, "--concurrency", 1, MAX_CONCURRENCY, "a concurrency")


def workload(suite: str, prompts: str, requests: int | str, temperature: float | str,
             thinking: bool, max_tokens: int | str) -> Workload:
    """The workload, checked: the owner's prompts file is read and parsed here (a regular file of at
    most 16 MiB of JSON lines with a "prompt" each; sparkspec.bench.suites), before any play."""
    if prompts and suite != "all":
        raise UserError("--prompts and --suite both given; the prompts file is the workload, drop "
                        "--suite")
    if suite not in SUITES:
        raise UserError(f"--suite: {suite!r} is not one of {', '.join(SUITES)}; or give your own "
                        "prompts with --prompts FILE.jsonl")
    requests = whole(requests or 0, "--requests", MAX_REQUESTS)
    max_tokens = whole(max_tokens or 0, "--max-tokens", MAX_TOKENS)
    try:
        temp = float(str(temperature)) if not isinstance(temperature, bool) else math.nan
    except ValueError:
        raise UserError(f"--temperature: {str(temperature)[:40]!r} is not a number; "
                        "e.g. 0 or 0.6") from None
    if not 0 <= temp <= 2:   # NaN too
        raise UserError(f"--temperature: {temperature!r} is outside 0..2; give the temperature you "
                        "serve at")
    path = ""
    if prompts:
        if Path(prompts).suffix != ".jsonl":
            raise UserError(f"--prompts {prompts}: not a .jsonl file; give JSON lines with a "
                            "\"prompt\" each (the bench suites' format)")
        full = os.path.abspath(prompts)
        if not full.isprintable() or any(t in full for t in ("{{", "{%", "{#")):
            # the path reaches the play as an extra variable, which Ansible would template
            raise UserError(f"--prompts {full!r}: a path with a control character or a Jinja "
                            "marker ({{, {%, {#}); rename the file or its folder")
        if os.path.islink(prompts):
            raise UserError(f"--prompts {prompts}: a symbolic link; give the file itself")
        suites.load(prompts)   # empty, not JSON lines, too big, not UTF-8 or a folder: one line
        path = os.path.abspath(prompts)
    return Workload("prompts" if path else suite, path, requests or None, temp, bool(thinking),
                    max_tokens or None)


def staged_profile(host_vars: dict[str, Any], asked: str) -> str:
    """``--profile``, else the inventory's: one the host stages (a sweep switches k, never
    downloads)."""
    default = str(host_vars.get("sparkspec_profile") or "")
    staged = host_vars.get("sparkspec_stage_profiles") or [default]
    profile = asked or default
    if profile not in staged:
        raise UserError(f"--profile {profile}: not staged on this host (staged: "
                        f"{', '.join(map(str, staged))}); add it to sparkspec_stage_profiles and "
                        "provision once")
    return profile


def method_spec(host_vars: dict[str, Any], method: str, profile: str,
                cluster: dict[str, Any] | None = None) -> dict[str, Any]:
    """The method resolved as its deploy will be (the registry's own checks and lines): it must
    draft."""
    contract = {key: host_vars.get(f"sparkspec_{key}") for key in registry.CONTRACT_KEYS}
    resolved = registry.resolve({**contract, "method_switch": method, "profile": profile}, None, "",
                                cluster=cluster)
    if resolved["speculative_config"] is None:
        drafting = _drafting(contract, profile, cluster, resolved["methods"])
        raise UserError(f"--method {method}: drafts nothing (no speculative_config), so it has no "
                        f"k; tune a method that drafts: {', '.join(drafting) or 'none is defined'}")
    return resolved


def _drafting(contract: dict[str, Any], profile: str, cluster: dict[str, Any] | None,
              methods: list[str]) -> list[str]:
    out = []
    for m in methods:
        try:
            if registry.resolve({**contract, "method_switch": m, "profile": profile}, None, "",
                                cluster=cluster)["speculative_config"] is not None:
                out.append(m)
        except UserError:
            continue   # a method this profile cannot serve (no head): not offered
    return out


@dataclass(frozen=True)
class Restore:
    """What served before the sweep, as the play that puts it back: method, profile, and its k where
    it differs from what the inventory gives that method."""

    method: str
    profile: str
    extra: dict[str, Any]


def restore_of(host_vars: dict[str, Any], host: str, served: dict[str, Any],
               cluster: dict[str, Any] | None = None) -> Restore:
    """Checked before the sweep: a sweep measures against a host that serves, healthy, something the
    inventory can deploy again (the record on the host is not trusted: its method and profile must
    resolve from the inventory, so nothing it says reaches a play unchecked)."""
    method, profile, k = served.get("method"), served.get("profile"), served.get("k")
    fix = f"deploy a method first (invoke deploy --host {host} --method baseline)"
    if not method or served.get("state") != "active" or served.get("health") != 200:
        raise UserError(f"{host} serves {method or 'nothing'} (unit {served.get('state')}, /health "
                        f"{served.get('health')}): tune measures against a healthy host and puts "
                        f"back what served; {fix}")
    contract = {key: host_vars.get(f"sparkspec_{key}") for key in registry.CONTRACT_KEYS}
    raw = contract.get("profiles")
    profiles: dict[str, Any] = raw if isinstance(raw, dict) else {}
    if not isinstance(profile, str) or profile not in profiles or not isinstance(method, str):
        raise UserError(f"{host}'s record says it serves {str(method)[:64]!r} on profile "
                        f"{str(profile)[:64]!r}, which the inventory does not define; {fix}")
    try:
        resolved = registry.resolve({**contract, "method_switch": method, "profile": profile},
                                    None, "", cluster=cluster)
    except UserError as exc:
        raise UserError(f"{host} serves {method} on {profile}, which the inventory cannot deploy "
                        f"again ({exc}); {fix}") from None
    extra: dict[str, Any] = {"sparkspec_profile": profile}
    spec = resolved["speculative_config"]
    if spec is not None and type(k) is int and k != spec.get("num_speculative_tokens"):
        extra["sparkspec_num_speculative_tokens"] = {
            **(contract.get("num_speculative_tokens") or {}), method: k}
    return Restore(method, profile, extra)


# the verify role's check of its name
REPORT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+=,-]{0,127}")


def check_names(plan: list[Row], head: str, group: str | None) -> None:
    """Every name that becomes a path: the rows' results (the verify role's own pattern, no '..'),
    the head (reports/<head>/) and a cluster's group (group_vars/<group>.yml)."""
    for row in plan:
        if not REPORT_NAME.fullmatch(row.name) or ".." in row.name:
            raise UserError(f"--method {row.method}: its results name {row.name!r} is not a file "
                            "name the verify role accepts (no '..'); rename the method")
    for what, name in (("host", head), ("group", group)):
        if name is not None and (not REPORT_NAME.fullmatch(name) or ".." in name or "@" in name):
            raise UserError(f"{what} {name!r}: not a plain name (letters, digits, '.', '_', '-'; "
                            "no '..'), and it names report and inventory files; rename it in the "
                            "inventory")


def block_limit(head_config: dict[str, Any] | None) -> int:
    """The most k a method allows: 64 (sparkspec's bound), a DFlash head's block_size - 1 (vLLM
    drafts one block per step: the first position is the last accepted token)."""
    if head_config is None:
        return MAX_SPECULATIVE_TOKENS
    block = (head_config.get("dflash_config") or {}).get("block_size") if isinstance(
        head_config.get("dflash_config"), dict) else None
    if type(block) is not int or block < 2:
        raise UserError(f"the DFlash head's config.json has dflash_config.block_size {block!r}, "
                        "not an integer >= 2; re-fetch the head (invoke provision --tags "
                        "checkpoints)")
    return min(block - 1, MAX_SPECULATIVE_TOKENS)


def rows(method: str, ks: list[int], levels: list[int]) -> list[Row]:
    """Baseline, then k_max, then the other k ascending; each k at every level (the first one
    deploys)."""
    order = [0, ks[-1], *ks[:-1]]
    return [Row(method, k, c, i == 0) for k in order for i, c in enumerate(levels)]


def extra_vars(row: Row, profile: str, tuned: dict[str, Any], load: Workload, reports: str,
               levers: Iterable[str] = (), host_levers: Any = None) -> dict[str, Any]:
    """The row's vars on top of its method's playbook: its k (over the host's own per-method k), the
    tuned method's levers (baseline's row too: like is compared with like; options from the host's
    own block, ``host_levers``), its workload, results under ``reports``, and no floors (a bad k is
    a result, not a failure)."""
    extra: dict[str, Any] = {
        "sparkspec_profile": profile,
        "sparkspec_levers": exact_block(levers, host_levers),
        "sparkspec_num_speculative_tokens": {**tuned, **({row.method: row.k} if row.k else {})},
        "verify_report_name": row.name, "verify_reports_dir": reports,
        "verify_enforce_floors": False,
        "verify_concurrency": row.concurrency, "verify_temperature": load.temperature,
        "verify_enable_thinking": load.thinking, "verify_prompts_file": load.prompts,
        "verify_suite": "all" if load.prompts else load.suite, "verify_requests": load.requests,
        # baseline records this profile's lossless reference again; a verify-only level repeats no
        # check
        "verify_rerecord_reference": row.k == 0 and row.deploy, "verify_lossless": row.deploy,
    }
    if load.max_tokens:
        extra["verify_max_tokens"] = load.max_tokens
    return extra
