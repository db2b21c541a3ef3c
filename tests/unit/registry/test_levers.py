"""Levers in the registry: the blocks checked and merged, what the unit carries, the release and
head checks, the memory guard's key and compare's lever rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sparkspec import registry
from sparkspec.errors import UserError
from sparkspec.operate import memfit
from sparkspec.registry import levers
from tasks.compare import plan as compare_plan

# the model's config.json, the fields the lever reads (docs/spark-facts.md: lm_head_shape)
QWEN35_122B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "tie_word_embeddings": False,
    "text_config": {"vocab_size": 248320, "hidden_size": 3072, "dtype": "bfloat16"},
}


def _contract(**extra: Any) -> dict[str, Any]:
    profile = {"kind": "plain", "dir": "m", "model": {"repo": "o/m", "revision": "main"}}
    return {"method": "baseline", "profile": "p",
            "profiles": {"p": {**profile, **extra.pop("profile", {})}}, "models_dir": "/opt/m",
            "sources_dir": "/opt/m/s", "heads_dir": "/opt/m/h", "vllm_venv": "/opt/v", **extra}


def _command(resolved: dict[str, Any]) -> dict[str, Any]:
    return registry.vllm_command(resolved, {"unit": "u", "bind_address": "127.0.0.1", "port": 8000,
                                            "user": "s"})


def test_off_by_default_and_nothing_of_it_in_the_unit() -> None:
    resolved = registry.resolve(_contract())
    assert resolved["levers"] == {}
    out = _command(resolved)
    assert registry.LEVERS_ENV not in out["env"] and "levers" not in out["record"]
    assert not any("lever" in a.lower() for a in out["args"])


def test_on_lands_in_the_environment_and_the_record_only() -> None:
    off = _command(registry.resolve(_contract()))
    on = _command(registry.resolve(_contract(levers={"int8_lm_head": True})))
    assert on["env"][registry.LEVERS_ENV] == '{"int8_lm_head":{"min_vocab":100000}}'
    assert on["record"]["levers"] == {"int8_lm_head": {"min_vocab": 100000}}
    # vLLM's own command line is the same: the plugin reads the env
    assert on["args"] == off["args"]


def test_layers_merge_profile_method_host_keeping_options() -> None:
    profile = {"levers": {"int8_lm_head": {"enabled": False, "min_vocab": 256}}}
    assert registry.resolve(_contract(profile=profile))["levers"] == {}
    on = registry.resolve(_contract(profile=profile, levers={"int8_lm_head": True}))
    # the host turns it on, the profile's option
    assert on["levers"] == {"int8_lm_head": {"min_vocab": 256}}
    methods = {"fast": {"speculative_config": None, "levers": ["int8_lm_head"]}}
    by_method = registry.resolve(_contract(method="fast", methods=methods))
    assert by_method["levers"] == {"int8_lm_head": {"min_vocab": 100000}}
    host_off = registry.resolve(_contract(method="fast", methods=methods,
                                          levers={"int8_lm_head": False}))
    assert host_off["levers"] == {}


@pytest.mark.parametrize(("block", "message"), [
    ({"int8_lm_heda": True},
     "sparkspec_levers.int8_lm_heda: unknown lever; did you mean int8_lm_head?"),
    ({"int8_lm_head\nExecStartPre=/bin/sh": True}, "is not a lever name"),
    ({"x; rm -rf /": True}, "is not a lever name"),
    ({"Int8": True}, "is not a lever name"),
    ({"int8_lm_head": "yes"}, "'yes' is not true (on), false (off) or a mapping"),
    ({"int8_lm_head": {"min_vocab": -1}},
     "sparkspec_levers.int8_lm_head.min_vocab: -1 is not an integer"),
    ({"int8_lm_head": {"min_vocab": True}}, "min_vocab: True is not an integer"),
    ({"int8_lm_head": {"rows": 4}},
     "sparkspec_levers.int8_lm_head.rows: not an option of lever int8_lm_head"),
    ({"int8_lm_head": {"enabled": "no"}},
     "sparkspec_levers.int8_lm_head.enabled: 'no' is not true or false"),
    ("int8_lm_head", "sparkspec_levers: is a str; give a mapping of lever name"),
    ([{"int8_lm_head": {"min_vocab": 1}}],
     "sparkspec_levers[0]: {'int8_lm_head': {'min_vocab': 1}} is not a "
                                           "lever name"),
], ids=["misspelt", "newline", "shell", "upper", "not-bool", "negative", "bool-count", "option",
        "enabled", "string", "list-of-mappings"])
def test_bad_lever_blocks_are_one_line(block: Any, message: str) -> None:
    with pytest.raises(UserError) as err:
        registry.resolve(_contract(levers=block))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_profile_or_method_lever_is_checked_where_it_is_written() -> None:
    with pytest.raises(UserError, match=r"^sparkspec_profiles\.p\.levers\.nope: unknown lever"):
        registry.resolve(_contract(profile={"levers": ["nope"]}))
    methods = {"m": {"speculative_config": None, "levers": {"int8_lm_head": 1}}}
    with pytest.raises(UserError,
                       match=r"^sparkspec_methods\.m\.levers\.int8_lm_head: 1 is not true"):
        registry.resolve(_contract(methods=methods))


@pytest.mark.parametrize(("release", "fits"),
                         [("0.32.0", True), ("0.32.0+cpu", True), ("0.31.0", False),
                          ("0.34.0", False), ("", False)])
def test_release(release: str, fits: bool) -> None:
    problems = levers.release_problems({"int8_lm_head": {}}, release)
    assert (problems == []) == fits
    # unknown (a source build at a git ref): the lever cannot be checked, so refused
    if release == "":
        assert problems[0].startswith("lever int8_lm_head needs a known vLLM release (0.32.0)")
    elif not fits:
        assert problems[0].startswith(f"lever int8_lm_head does not fit vLLM {release}: "
                                      "its hooks were read against vLLM 0.32.0")


def _head(config: Any, min_vocab: int = 100000) -> list[str]:
    return levers.head_problems({"int8_lm_head": {"min_vocab": min_vocab}}, config, "/m/q")


def test_head_of_the_122b_fits() -> None:
    assert _head(QWEN35_122B) == []
    assert _head({"vocab_size": 151936, "torch_dtype": "float16",
                  "tie_word_embeddings": False}) == []


@pytest.mark.parametrize(("change", "message"), [
    ({"tie_word_embeddings": True}, "ties its LM head to the embedding"),
    ({"text_config": {**QWEN35_122B["text_config"], "dtype": "float32"}},
     "LM head is 'float32', not bfloat16"),
    ({"text_config": {"vocab_size": 248320}}, "LM head is None, not bfloat16 or float16"),
    ({"quantization_config": {"quant_lm_head": True}},
     "LM head is quantized (quantization_config)"),
    ({"quantization_config": {"lm_head": True, "bits": 4}}, "LM head is quantized"),
    ({"text_config": {**QWEN35_122B["text_config"], "vocab_size": 32000}},
     "vocabulary (32000) is below the lever's min_vocab 100000"),
    ({"text_config": {**QWEN35_122B["text_config"], "vocab_size": "248320"}},
     "vocabulary ('248320')"),
], ids=["tied", "fp32", "no-dtype", "autoround-head", "gptq-head", "small-vocab", "vocab-string"])
def test_heads_the_lever_cannot_take(change: dict[str, Any], message: str) -> None:
    problems = _head({**QWEN35_122B, **change})
    assert len(problems) == 1 and message in problems[0], problems
    assert problems[0].startswith("lever int8_lm_head: ") and "turn the lever off" in problems[0]


def test_min_vocab_is_the_threshold() -> None:
    small = {"vocab_size": 512, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    assert _head(small, 256) == [] and _head(small, 513) != []
    off = ("turn the lever off for this profile "
           "(sparkspec_profiles.<profile>.levers: {int8_lm_head: false})")
    assert _head([1, 2]) == [f"lever int8_lm_head: /m/q's config.json is not a JSON object; {off}"]


def test_the_memory_guard_key_includes_the_levers(tmp_path: Path) -> None:
    record = {"profile": "p", "method": "mtp", "num_speculative_tokens": 2,
              "args": ["--model", "/m"]}
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(record))
    with_lever = tmp_path / "lever.json"
    with_lever.write_text(json.dumps({**record, "levers": {"int8_lm_head": {"min_vocab": 100000}}}))
    key_plain = memfit.start_key(str(plain), str(tmp_path / "venv"))
    key_lever = memfit.start_key(str(with_lever), str(tmp_path / "venv"))
    # a start without levers keeps the key it had before levers existed
    assert "levers" not in key_plain
    assert memfit.key_hash(key_plain) != memfit.key_hash(key_lever)
    assert "p/mtp+int8_lm_head k=2" in memfit.describe(key_lever)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**record, "levers": ["int8_lm_head"]}))
    with pytest.raises(UserError, match="'levers' is not a mapping of lever to options"):
        memfit.start_key(str(bad), str(tmp_path / "venv"))


def test_compare_rows_with_levers_get_their_own_baseline() -> None:
    rows = compare_plan.plan(compare_plan.parse("mtp,mtp+int8_lm_head,baseline", "p"))
    assert [(r.name, r.added) for r in rows] == [
        ("baseline@p", False), ("mtp@p", False), ("baseline+int8_lm_head@p", True),
        ("mtp+int8_lm_head@p", False)]
    assert compare_plan.lever_vars(rows[3]) == {"sparkspec_levers": {
        "int8_lm_head": {"enabled": True}, "prefix_caching": {"enabled": False}}}
    assert compare_plan.lever_vars(rows[0]) == {"sparkspec_levers": {
        "int8_lm_head": {"enabled": False}, "prefix_caching": {"enabled": False}}}


def test_a_rows_levers_keep_the_hosts_own_options() -> None:
    """A compare or tune row turns levers on or off; the options the host's own block gives stay."""
    host = {"int8_lm_head": {"min_vocab": 50000}}
    block = levers.exact_block(["int8_lm_head"], host)
    assert block == {"int8_lm_head": {"min_vocab": 50000, "enabled": True},
                     "prefix_caching": {"enabled": False}}
    resolved = registry.resolve(_contract(levers=block))
    assert resolved["levers"] == {"int8_lm_head": {"min_vocab": 50000}}
    assert levers.exact_block([], host)["int8_lm_head"] == {"min_vocab": 50000, "enabled": False}
    assert levers.exact_block(["prefix_caching"], None) == {"int8_lm_head": {"enabled": False},
                                                            "prefix_caching": {"enabled": True}}


@pytest.mark.parametrize(("methods", "message"), [
    ("mtp+int8_lm_heda", "--methods mtp+int8_lm_heda.int8_lm_heda: unknown lever"),
    ("mtp+", "'mtp+' is not METHOD[+LEVER...][@PROFILE]"),
    ("mtp+int8_lm_head+int8_lm_head", "names a lever twice"),
    ("mtp+int8_lm_head,mtp+int8_lm_head@p", "mtp+int8_lm_head@p is listed twice"),
])
def test_bad_lever_rows(methods: str, message: str) -> None:
    with pytest.raises(UserError) as err:
        compare_plan.parse(methods, "p")
    assert message in str(err.value)


def test_the_plugin_knows_the_registrys_levers() -> None:
    """The plugin (levers/, no dependency on sparkspec) keeps its own copy of what it checks: each
    tied here to the registry, the one home."""
    import ast
    import sys

    src = Path(__file__).resolve().parents[3] / "levers" / "src"
    sys.path.insert(0, str(src))
    try:
        import sparkspec_levers
    finally:
        sys.path.remove(str(src))
    assert sparkspec_levers.ENV == registry.LEVERS_ENV
    # the plugin carries the plugin levers only; the serve levers become flags
    # (registry.levers.serve_values)
    assert sparkspec_levers.LEVERS == {lever: e["options"] for lever, e in registry.LEVERS.items()
                                       if "serve" not in e}
    # imports vLLM: read, not imported
    plugin = (src / "sparkspec_levers" / "plugin.py").read_text()
    assigns = {getattr(node.targets[0], "id", ""): node.value for node in ast.parse(plugin).body
               if isinstance(node, ast.Assign)}
    supported = ast.literal_eval(assigns["SUPPORTED_VLLM"])
    assert supported == registry.LEVERS["int8_lm_head"]["vllm"]
    assert f'"{registry.LEVERS["int8_lm_head"]["marker"]} ([%d, %d], saved %d MB)' in plugin


def test_the_plugin_folder_check(tmp_path: Path) -> None:
    """The deploy's check of a plugin folder (roles/deploy/files/levers_folder.py): whole, or one
    line."""
    import base64
    import hashlib
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[3] / "roles/deploy/files/levers_folder.py"
    folder = tmp_path / "abc"
    (folder / "sparkspec_levers").mkdir(parents=True)
    (folder / "sparkspec_levers-0.1.0.dist-info").mkdir()
    code = b"def register(): pass\n"
    (folder / "sparkspec_levers/__init__.py").write_bytes(code)
    digest = base64.urlsafe_b64encode(hashlib.sha256(code).digest()).rstrip(b"=").decode()
    (folder / "sparkspec_levers-0.1.0.dist-info/RECORD").write_text(
        f"sparkspec_levers/__init__.py,sha256={digest},{len(code)}\n"
        "sparkspec_levers-0.1.0.dist-info/RECORD,,\n")

    def check(where: Path = folder) -> tuple[int, str]:
        proc = subprocess.run([sys.executable, str(script), str(where), "sparkspec_levers"],
                              capture_output=True, text=True, check=False)
        return proc.returncode, proc.stdout.strip()

    assert check() == (0, "")
    (folder / "sparkspec_levers/__init__.py").write_bytes(code + b"import os\n")
    assert check() == \
        (1, f"{folder}/sparkspec_levers/__init__.py: not the file the plugin's RECORD names")
    (folder / "sparkspec_levers/__init__.py").unlink()
    rc, line = check()
    assert rc == 1 and line.endswith("No such file or directory")
    assert check(tmp_path / "none") == \
        (1, f"{tmp_path / 'none'}: 0 sparkspec_levers dist-info RECORDs, expected 1")


def test_a_serve_lever_sets_flags_and_no_plugin() -> None:
    """prefix_caching is flags on vLLM's command line: no SPARKSPEC_LEVERS, no plugin; the record
    keeps it (status, the memory guard's key); its match unit is one of the divisors of 16."""
    resolved = registry.resolve(_contract(levers={"prefix_caching": {"match_unit": 8}}))
    assert resolved["plugin_levers"] == [] and \
        resolved["levers"] == {"prefix_caching": {"match_unit": 8}}
    command = _command(resolved)
    args = command["args"]
    assert "--enable-prefix-caching" in args and args[args.index("--prefix-match-unit") + 1] == "8"
    assert registry.LEVERS_ENV not in command["env"]
    assert command["record"]["levers"] == {"prefix_caching": {"match_unit": 8}}
    with pytest.raises(UserError,
                       match=r"^sparkspec_levers\.prefix_caching\.match_unit: 12 is not one of "
                                        r"1, 2, 4, 8, 16 \(docs/methods\.md#levers\); fix it$"):
        registry.resolve(_contract(levers={"prefix_caching": {"match_unit": 12}}))
