"""What each molecule scenario needs from the controller, made once, cached under .cache/molecule/.

``python -m tests.support.molecule_inputs ROLE`` (from the repository root) is the scenario's
``dependency`` step (roles/ROLE/molecule/default/molecule.yml), so ``molecule test`` in a role's
folder prepares its own inputs, and tests/integration/test_molecule.py runs the same step on the
same cache. For every role: the simulated Spark's image, the CA bundle and the API key the
containers mount or read (:meth:`tests.support.sim.Sim.assets`), and podman's project-local
configuration (.sim/containers.conf). Then, per role:

- ``vllm_build``: :mod:`tests.support.standin_inputs` in .cache/molecule/vllm_build/, rewritten only
  when the stand-in sources change (a stamp holds their digest); ``vllm_build.json`` beside it gives
  the scenario the folder, the tarball's sha256 and flash-attention's commit.
- ``deploy``: the tiny model sim01 serves (same generator, seed 0) in
  .cache/molecule/deploy/sim-tiny, apart from .sim/gen, which sim01's hub writes.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from sparkspec.errors import UserError
from tests.support import standin_inputs
from tests.support.torch_standin import buildenv

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "molecule"
PROG = "python -m tests.support.molecule_inputs"
# What the vllm_build inputs are made from: a change to any of these files writes them again.
STANDIN_SOURCES = (standin_inputs.STANDIN, buildenv.HERE, standin_inputs.FA_FILES,
                   Path(standin_inputs.__file__))


def roles() -> list[str]:
    """The roles that have a molecule scenario."""
    return sorted(p.parts[-4] for p in ROOT.glob("roles/*/molecule/default/molecule.yml"))


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """One process at a time writes the cache (a user's molecule run beside the test suite's)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _digest(sources: tuple[Path, ...]) -> str:
    digest = hashlib.sha256()
    for source in sources:
        for path in sorted(source.rglob("*")) if source.is_dir() else [source]:
            name = path.relative_to(source.parent)
            skip = path.suffix == ".pyc" or any(
                p in ("__pycache__", "build") or p.endswith(".egg-info") for p in name.parts)
            if path.is_file() and not skip:
                digest.update(str(name).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def vllm_build(cache: Path = CACHE) -> Path:
    """The stand-in inputs of the vllm_build scenario, cached; returns the record the scenario
    reads."""
    out, record = cache / "vllm_build", cache / "vllm_build.json"
    want = _digest(STANDIN_SOURCES)
    if record.is_file() and json.loads(record.read_text()).get("digest") == want and out.is_dir():
        return record
    shutil.rmtree(out, ignore_errors=True)
    record.unlink(missing_ok=True)
    env = standin_inputs.write(out)
    record.write_text(json.dumps({"digest": want, "dir": env["SPARKSPEC_STANDIN_DIR"],
                                  "sha256": env["SPARKSPEC_STANDIN_SHA256"],
                                  "fa_commit": env["SPARKSPEC_STANDIN_FA_COMMIT"]},
                                 indent=1) + "\n")
    return record


def deploy(cache: Path = CACHE) -> Path:
    """The tiny model the deploy scenario serves (sim01's sim-tiny: same generator and seed); files
    already right are left as they are."""
    from tests.support.tinymodel import write_tiny_model

    return write_tiny_model(cache / "deploy" / "sim-tiny", seed=0).path


PER_ROLE: dict[str, Callable[[Path], Path]] = {"vllm_build": vllm_build, "deploy": deploy}


def prepare(role: str, cache: Path = CACHE, log: Callable[[str], object] = print) -> Path | None:
    """Everything the scenario of ``role`` reads from the controller; returns the role's own input
    (None when it has only the common ones)."""
    if role not in roles():
        raise UserError(f"role {role!r} has no molecule scenario; give one of {', '.join(roles())}")
    from tests.support.sim import Sim

    sim = Sim(ROOT)
    sim.env()   # writes .sim/containers.conf (runc), which the scenarios' podman reads
    if sim.assets(log=log):
        log(f"built the simulated Spark's image {sim.image}")
    with _locked(cache):
        made = PER_ROLE[role](cache) if role in PER_ROLE else None
    if made is not None:
        log(f"{role}: molecule inputs ready in {made}")
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="+",
                        help="a role with a molecule scenario (roles/ROLE/molecule/default)")
    args = parser.parse_args(argv)
    try:
        for role in args.role:
            prepare(role)
    except UserError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
