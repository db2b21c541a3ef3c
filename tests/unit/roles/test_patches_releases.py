"""The INC and SM121 patches each release record names apply with ``patch -p1 --fuzz=0`` to that
release's own files (tests/data/vllm-releases, copied from its sdist), and the patched inc.py
imports only names that release defines. A changed context line is refused."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

from sparkspec.registry.releases import RELEASES

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data" / "vllm-releases"
INC = "vllm/model_executor/layers/quantization/inc"
PATCH_DIRS = {"inc": ROOT / "roles/vllm_install/files/patches",
              "arch": ROOT / "roles/vllm_build/files/patches"}
TARGETS = {"inc": f"{INC}/inc.py", "arch": "CMakeLists.txt"}
CASES = [(v, kind) for v, r in RELEASES.items() for kind in ("inc", "arch")
         if getattr(r, f"{kind}_patch")]
INC_CASES = [v for v, r in RELEASES.items() if r.inc_patch]
SAFETENSORS = "vllm/transformers_utils/config.py def get_safetensors_params_metadata"


def patch_file(version: str, kind: str) -> Path:
    name = getattr(RELEASES[version], f"{kind}_patch")
    assert isinstance(name, str)
    return PATCH_DIRS[kind] / name


def copy_target(tmp: Path, version: str, kind: str) -> Path:
    dest = tmp / TARGETS[kind]
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(DATA / version / TARGETS[kind], dest)
    return dest


def run_patch(src: Path, patch: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["patch", "-p1", "--fuzz=0", "--batch", "--forward",
                           "--no-backup-if-mismatch", *extra, "-d", str(src), "-i", str(patch)],
                          capture_output=True, text=True, check=False)


def apply(tmp: Path, version: str, kind: str) -> Path:
    target = copy_target(tmp, version, kind)
    before = target.read_bytes()
    dry = run_patch(tmp, patch_file(version, kind), "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert target.read_bytes() == before
    real = run_patch(tmp, patch_file(version, kind))
    assert real.returncode == 0, real.stdout + real.stderr
    assert target.read_bytes() != before
    return target


def module_names(path: Path) -> set[str]:
    """The names bound by the module's own top-level statements."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def imports_from(tree: ast.AST, module: str, level: int) -> set[str]:
    return {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and node.module == module and node.level == level for a in node.names}


@pytest.mark.parametrize(("version", "kind"), CASES)
def test_the_patch_applies_with_no_fuzz(tmp_path: Path, version: str, kind: str) -> None:
    target = apply(tmp_path, version, kind)
    if kind == "arch":  # both CUDA >= 13 lists gain 12.1
        before = (DATA / version / TARGETS[kind]).read_text()
        assert target.read_text().count(';12.0;12.1"') == before.count(';12.0;12.1"') + 2


@pytest.mark.parametrize("version", INC_CASES)
def test_the_patched_inc_imports_what_the_release_defines(tmp_path: Path, version: str) -> None:
    tree = ast.parse(apply(tmp_path, version, "inc").read_text(encoding="utf-8"))
    for module, rel in (("config_parser", "config_parser.py"),
                        ("schemes.factory", "schemes/factory.py")):
        wanted = imports_from(tree, module, 1)
        assert wanted, module
        assert wanted <= module_names(DATA / version / INC / rel), (module, wanted)
    assert imports_from(tree, "vllm.transformers_utils.config", 0) == {
        "get_safetensors_params_metadata"}
    manifest = (DATA / version / "MANIFEST.txt").read_text(encoding="utf-8").splitlines()
    assert f"{SAFETENSORS}: yes" in manifest
    # INCLayerConfig(...) as the patch calls it: one positional argument per dataclass field
    parser = ast.parse((DATA / version / INC / "config_parser.py").read_text(encoding="utf-8"))
    (layer_cfg,) = [n for n in parser.body if isinstance(n, ast.ClassDef)
                    and n.name == "INCLayerConfig"]
    n_fields = sum(isinstance(s, ast.AnnAssign) for s in layer_cfg.body)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == "INCLayerConfig"]
    assert calls and all(len(c.args) == n_fields and not c.keywords for c in calls)


@pytest.mark.parametrize("version", INC_CASES)
def test_a_changed_context_line_is_refused(tmp_path: Path, version: str) -> None:
    target = copy_target(tmp_path, version, "inc")
    context = "from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead\n"
    text = target.read_text(encoding="utf-8")
    assert text.count(context) == 1  # the first hunk's context line, as the patch has it
    target.write_text(text.replace(context, context.replace("ParallelLMHead", "ParallelLMHead  ")))
    before = target.read_bytes()
    result = run_patch(tmp_path, patch_file(version, "inc"), "--dry-run")
    assert result.returncode == 1
    assert "Hunk #1 FAILED" in result.stdout
    assert target.read_bytes() == before
