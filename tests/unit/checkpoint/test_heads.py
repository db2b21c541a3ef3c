"""``sparkspec checkpoint check-head``: the generated EAGLE3 and DFlash heads pass against the tiny
target, and each bad head (built by the generator, then corrupted) is refused in one line naming the
field, exit 2, nothing changed. The distilled EAGLE3 weights do not matter here: the random layout
(steps=0) is the same files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.badinput import refused_untouched, run
from tests.support import heads


@pytest.fixture(scope="session")
def head_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("heads")
    heads.write_eagle3_head(root / "eagle3", steps=0)
    heads.write_dflash_head(root / "dflash")
    return root


@pytest.fixture
def tree(head_sources: Path, tmp_path: Path) -> Path:
    for name in ("eagle3", "dflash", heads.target_dir(head_sources / "eagle3").name):
        shutil.copytree(head_sources / name, tmp_path / name)
    return tmp_path


def _target(tree: Path) -> Path:
    return tree / "sparkspec--sim-tiny"


def _check(tree: Path, method: str, head: str | None = None) -> list[str | Path]:
    return ["checkpoint", "check-head", "--method", method, "--head", tree / (head or method),
            "--target", _target(tree)]


def _edit(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_generated_heads_fit_the_tiny_target(tree: Path, method: str) -> None:
    out = run(*_check(tree, method), "--json")
    assert out.rc == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["method"] == method and doc["hidden_size"] == 256 and doc["target_layers"] == 2
    assert doc["aux_layers"] == (heads.EAGLE3_AUX_IDS if method == "eagle3"
                                 else heads.DFLASH_TARGET_LAYERS)
    assert f"{method} head OK" in out.stderr


def _drop(key: str) -> Callable[[dict[str, Any]], object]:
    return lambda d: d.pop(key)


def _set(key: str, value: object, under: str | None = None) -> Callable[[dict[str, Any]], object]:
    return lambda d: (d[under] if under else d).__setitem__(key, value)


CASES = [
    # (id, method, file to corrupt relative to the tree, change, expected error regex)
    ("head-hidden-mismatch", "eagle3", "eagle3/config.json", _set("target_hidden_size", 512),
     r"target_hidden_size 512 does not match the target's hidden_size 256"),
    ("dflash-hidden-mismatch", "dflash", "dflash/config.json",
     lambda d: (d.pop("target_hidden_size"), d.__setitem__("hidden_size", 128)),
     r"hidden_size 128 does not match the target's hidden_size 256"),
    ("target-of-other-size", "eagle3", "sparkspec--sim-tiny/config.json", _set("hidden_size", 1024),
     r"target_hidden_size 256 does not match the target's hidden_size 1024"),
    ("dflash-without-dflash-config", "dflash", "dflash/config.json", _drop("dflash_config"),
     r"no dflash_config \(block_size, mask_token_id, target_layer_ids\)"),
    ("dflash-layer-out-of-range", "dflash", "dflash/config.json",
     _set("target_layer_ids", [0, 2], "dflash_config"),
     r"dflash_config.target_layer_ids \[0, 2\] has \[2\] outside 0..1"),
    ("dflash-layer-negative", "dflash", "dflash/config.json",
     _set("target_layer_ids", [-1, 1], "dflash_config"), r"has \[-1\] outside 0..1"),
    ("dflash-mask-outside-vocab", "dflash", "dflash/config.json",
     _set("mask_token_id", 512, "dflash_config"), r"mask_token_id 512 is outside the vocabulary"),
    ("dflash-block-size", "dflash", "dflash/config.json", _set("block_size", 1, "dflash_config"),
     r"block_size is 1, expected an integer >= 2"),
    ("eagle3-aux-out-of-range", "eagle3", "eagle3/config.json",
     _set("eagle_aux_hidden_state_layer_ids", [0, 3], "eagle_config"), r"\[3\] outside 0..2"),
    ("eagle3-aux-not-ints", "eagle3", "eagle3/config.json",
     _set("eagle_aux_hidden_state_layer_ids", ["a"], "eagle_config"), r"expected a non-empty list"),
    ("eagle3-fc-vs-aux-count", "eagle3", "eagle3/config.json",
     _set("eagle_aux_hidden_state_layer_ids", [0, 1, 2], "eagle_config"),
     r"fc.weight is \[256, 512\], expected \[256, 768\] for 3 aux states"),
    ("eagle3-vocab", "eagle3", "eagle3/config.json", _set("draft_vocab_size", 1000),
     r"vocabulary 1000 differs from the target's 512"),
    ("dflash-given-eagle3-head", "dflash", "eagle3/config.json", lambda d: None,
     r"a DFlash head has \[DFlashDraftModel\]"),
    ("eagle3-given-dflash-head", "eagle3", "dflash/config.json", lambda d: None,
     r"not an EAGLE3 head"),
]


@pytest.mark.parametrize(("method", "rel", "change", "match"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_head_is_refused(tree: Path, method: str, rel: str,
                             change: Callable[[dict[str, Any]], object], match: str) -> None:
    _edit(tree / rel, change)
    head = rel.split("/")[0] if not rel.startswith("sparkspec--") else method
    refused_untouched(_check(tree, method, head), [tree], match=match)


def test_missing_head_files(tree: Path) -> None:
    (tree / "eagle3" / "model.safetensors").unlink()
    refused_untouched(_check(tree, "eagle3"), [tree],
                      match=r"no \*.safetensors in the head's folder")
    shutil.rmtree(tree / "dflash")
    refused_untouched(_check(tree, "dflash"), [tree], match=r"head config.json not found")
    (tree / "eagle3" / "config.json").write_text("{not json")
    refused_untouched(_check(tree, "eagle3"), [tree], match=r"head config.json unreadable")


def test_generator_is_cached_by_content(head_sources: Path, tmp_path: Path) -> None:
    """A second run with the same target, version and seed rewrites nothing; another seed
    regenerates."""
    shutil.copytree(head_sources, tmp_path / "h")
    first = heads.write_dflash_head(tmp_path / "h" / "dflash")
    assert not first.trained
    mtime = (tmp_path / "h" / "dflash" / "model.safetensors").stat().st_mtime_ns
    assert heads.write_eagle3_head(tmp_path / "h" / "eagle3", steps=0).trained is False
    other = heads.write_dflash_head(tmp_path / "h" / "dflash", seed=1)
    assert other.trained and other.key != first.key
    assert (tmp_path / "h" / "dflash" / "model.safetensors").stat().st_mtime_ns != mtime


def test_distillation_runs_after_ansible_patched_the_interpreter(tmp_path: Path) -> None:
    """The simulated hub distils the EAGLE3 head inside a pytest session that has already read an
    inventory with Ansible, which replaces sys.intern; torch's compiler machinery (imported by Adam)
    then fails to import. The training runs in a fresh interpreter, so it works here too (CI's first
    session trains the head this way)."""
    import sys

    from tasks.lib import inventory

    inventory.load("inventories/sim").host_vars("sim01", ("sparkspec_unit_name",))
    assert type(sys.intern).__name__ != "builtin_function_or_method"   # Ansible's patch is in place
    head = heads.write_eagle3_head(tmp_path / "sparkspec--sim-tiny-EAGLE3", seed=0, steps=2)
    assert head.trained and head.train_accuracy is not None and 0.0 <= head.train_accuracy <= 1.0
    assert (head.path / "model.safetensors").is_file()


def test_a_dflash_k_must_fit_the_heads_block(tree: Path) -> None:
    """The deploy passes the method's k: the head's own block (the bonus token and k drafts) must
    hold it."""
    block = json.loads((tree / "dflash" / "config.json").read_text())["dflash_config"]["block_size"]
    out = run(*_check(tree, "dflash"), "--k", str(block - 1))
    assert out.rc == 0, out.stderr
    refused_untouched([*_check(tree, "dflash"), "--k", str(block)], [tree],
                      match=rf"k {block} does not fit this DFlash head's block \(dflash_config."
                            rf"block_size {block}: the bonus token and k drafts\); set "
                            rf"num_speculative_tokens <= {block - 1}")
