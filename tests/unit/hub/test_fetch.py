"""Fetching through huggingface_hub from the local HF-compatible endpoint on 127.0.0.1: the ranged
FP8 subset (bytes and assemble identity), resume, whole-shard fallback, local_path, preflight,
401/404."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sparkspec.checkpoint.assemble import MANIFEST_NAME, assemble
from sparkspec.checkpoint.safetensors_io import read_header, read_index
from sparkspec.cli import main
from sparkspec.errors import UserError
from sparkspec.hub.fetch import fetch_fp8_subset, fetch_repo
from sparkspec.hub.server import HubServer
from tests.support.hubfaults import FaultyHub
from tests.support.hubpublish import publish
from tests.support.testckpt import ModelSpec, write_fp8, write_int4_autoround

FP8_REPO = "Qwen/tiny-FP8"
# shared-expert projections of 1024 x 1024: 1 MiB per FP8 weight
SPEC = ModelSpec(hidden=1024, layers=4, experts=2, moe_intermediate=128, shared_intermediate=1024,
                 heads=2, kv_heads=1, head_dim=128, linear_key_heads=2, linear_value_heads=2,
                 linear_key_dim=64, linear_value_dim=64, vocab=256)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("ckpts")
    write_int4_autoround(base / "int4", SPEC, shards=2)
    write_fp8(base / "fp8", SPEC, shards=3)
    publish(base / "root", FP8_REPO, base / "fp8")
    return {"base": base, "int4": base / "int4", "fp8": base / "fp8", "root": base / "root"}


@pytest.fixture()
def server(ckpts: dict[str, Path]):
    with FaultyHub(ckpts["root"]) as srv:
        yield srv


def _needed(fp8: Path) -> tuple[dict[str, int], int]:
    """The FP8 tensors the hybrid takes (shared-expert weights and scales, by the generator's
    layout) and the header bytes of the shards that hold them."""
    headers = [read_header(p) for p in sorted(fp8.glob("*.safetensors"))]
    needed = {t.name: t.nbytes for h in headers for t in h.tensors.values()
              if ".shared_expert." in t.name and not t.name.startswith("mtp.")}
    return needed, sum(h.data_start for h in headers if any(n in h.tensors for n in needed))


def _shards(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.safetensors"))


def _same_hybrid(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir() if p.name != MANIFEST_NAME)
    assert names == sorted(p.name for p in b.iterdir() if p.name != MANIFEST_NAME)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def reference(ckpts: dict[str, Path]) -> Path:
    """The hybrid assembled from the whole FP8 checkpoint, downloaded from the endpoint."""
    with HubServer(ckpts["root"]) as srv:
        full = fetch_repo(FP8_REPO, "main", ckpts["base"] / "fp8-full", endpoint=srv.url)
    assert full.changed and "model-00003-of-00003.safetensors" in full.files
    assemble(ckpts["int4"], ckpts["base"] / "fp8-full", ckpts["base"] / "hybrid-full")
    return ckpts["base"] / "hybrid-full"


def test_ranged_subset_fetches_only_needed_bytes_and_assembles_identically(
        ckpts: dict[str, Path], server: FaultyHub, reference: Path, tmp_path: Path) -> None:
    needed, header_bytes = _needed(ckpts["fp8"])
    assert len(needed) == 2 * 3 * SPEC.layers
    assert min(n for name, n in needed.items() if name.endswith(".weight")) >= 1 << 20
    server.stats.reset()

    result = fetch_fp8_subset(FP8_REPO, "main", ckpts["int4"], tmp_path / "sub",
                              endpoint=server.url)

    assert result.tensors == len(needed) and result.tensor_bytes_used == sum(needed.values())
    assert result.tensor_bytes_fetched <= 1.1 * result.tensor_bytes_used
    served = sum(n for key, n in server.stats.file_bytes.items() if key.endswith(".safetensors"))
    assert result.header_bytes == header_bytes
    assert served - header_bytes <= 1.1 * sum(needed.values())
    whole = sum(p.stat().st_size for p in ckpts["fp8"].glob("*.safetensors"))
    assert served < 0.5 * whole
    sub_index = read_index(tmp_path / "sub")["weight_map"]
    assert sorted(sub_index) == sorted(needed)

    assemble(ckpts["int4"], tmp_path / "sub", tmp_path / "hybrid")
    _same_hybrid(tmp_path / "hybrid", reference)
    config = json.loads((tmp_path / "hybrid" / "config.json").read_text())
    # the pinned commit reaches the hybrid
    assert config["sparkspec_hybrid"]["fp8_revision"] == result.commit

    server.stats.reset()
    again = fetch_fp8_subset(FP8_REPO, "main", ckpts["int4"], tmp_path / "sub", endpoint=server.url)
    assert not again.changed and again.bytes_fetched == 0
    assert sum(server.stats.file_bytes.values()) == 0


def test_resume_after_interrupted_fetch(ckpts: dict[str, Path], server: FaultyHub, reference: Path,
                                        tmp_path: Path) -> None:
    dest = tmp_path / "sub"
    # The second shard's tensor range is cut after 1 MiB (its header read is smaller and passes).
    # With retries the transfer resumes at the next byte in the same run: nothing is sent twice.
    server.cut("model-00002-of-00003.safetensors", after=1 << 20)
    survived = fetch_fp8_subset(FP8_REPO, "main", ckpts["int4"], tmp_path / "survived",
                                endpoint=server.url)
    assert server.requests[-1][2].startswith("bytes=") and server.requests[-1][3] == 206
    shard2 = read_header(tmp_path / "survived" / "model-00002-of-00003.safetensors")
    header2 = read_header(ckpts["fp8"] / "model-00002-of-00003.safetensors").data_start
    assert server.stats.file_bytes["Qwen/tiny-FP8/model-00002-of-00003.safetensors"] == \
        header2 + shard2.data_size
    assert survived.tensor_bytes_fetched == survived.tensor_bytes_used

    # Without retries the run fails; the re-run keeps the finished shard and fetches the rest.
    server.cut("model-00002-of-00003.safetensors", after=1 << 20)
    with pytest.raises(UserError, match="re-run to resume"):
        fetch_fp8_subset(FP8_REPO, "main", ckpts["int4"], dest, endpoint=server.url, retries=0)
    assert _shards(dest) == ["model-00001-of-00003.safetensors"]
    leftovers = [p.name for p in dest.rglob("*")
                 if p.suffix in (".part", ".lock", ".incomplete", ".tmp")]
    # the failed run leaves no temp file; the finished shard stays for the re-run
    assert leftovers == []

    server.stats.reset()
    result = fetch_fp8_subset(FP8_REPO, "main", ckpts["int4"], dest, endpoint=server.url)
    assert result.changed
    assert server.stats.file_bytes["Qwen/tiny-FP8/model-00001-of-00003.safetensors"] == 0  # kept
    assert server.stats.file_bytes["Qwen/tiny-FP8/model-00002-of-00003.safetensors"] == \
        result.tensor_bytes_fetched
    assert not list(dest.glob("*.part"))
    assemble(ckpts["int4"], dest, tmp_path / "hybrid")
    _same_hybrid(tmp_path / "hybrid", reference)


def test_full_shard_fallback_and_local_path(ckpts: dict[str, Path], server: FaultyHub,
                                            reference: Path, tmp_path: Path) -> None:
    full = fetch_fp8_subset(FP8_REPO, "main", ckpts["int4"], tmp_path / "full", endpoint=server.url,
                            mode="full")
    assert _shards(tmp_path / "full") == ["model-00001-of-00003.safetensors",
                                          "model-00002-of-00003.safetensors"]
    for name in _shards(tmp_path / "full"):
        assert (tmp_path / "full" / name).read_bytes() == (ckpts["fp8"] / name).read_bytes()
    assert full.tensor_bytes_fetched > full.tensor_bytes_used
    assemble(ckpts["int4"], tmp_path / "full", tmp_path / "hybrid-full")
    _same_hybrid(tmp_path / "hybrid-full", reference)

    local = fetch_fp8_subset(FP8_REPO, "main", ckpts["int4"], tmp_path / "local",
                             local_path=str(ckpts["root"] / FP8_REPO))
    ranged = fetch_fp8_subset(FP8_REPO, "main", ckpts["int4"], tmp_path / "ranged",
                              endpoint=server.url)
    assert local.tensor_bytes_used == ranged.tensor_bytes_used and local.commit == ranged.commit
    for name in _shards(tmp_path / "ranged"):
        assert (tmp_path / "local" / name).read_bytes() == (tmp_path / "ranged" / name).read_bytes()


def test_snapshot_of_plain_repo_with_pinned_revision(ckpts: dict[str, Path], server: FaultyHub,
                                                     tmp_path: Path) -> None:
    src = tmp_path / "plain"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "qwen3"}\n')
    (src / "model.safetensors").write_bytes(os.urandom(200_000))
    _, rev1, _ = publish(ckpts["root"], "org/plain", src)
    (src / "config.json").write_text('{"model_type": "qwen3", "v": 2}\n')
    _, rev2, _ = publish(ckpts["root"], "org/plain", src)
    with pytest.raises(UserError, match=f"revision {rev1} not found \\(404\\)"):
        # the endpoint serves one revision per repo: the replaced one is gone
        fetch_repo("org/plain", rev1, tmp_path / "old", endpoint=server.url)

    result = fetch_repo("org/plain", rev2, tmp_path / "dest", endpoint=server.url)
    assert (result.commit == rev2 and result.changed
            and result.files == ["config.json", "model.safetensors"])
    assert ((tmp_path / "dest" / "model.safetensors").read_bytes()
            == (src / "model.safetensors").read_bytes())
    server.stats.reset()
    again = fetch_repo("org/plain", rev2, tmp_path / "dest", endpoint=server.url)
    assert not again.changed and sum(server.stats.file_bytes.values()) == 0

    linked = fetch_repo("org/plain", "main", tmp_path / "air", local_path=str(src))
    assert linked.changed and (tmp_path / "air" / "model.safetensors").stat().st_ino == \
        (src / "model.safetensors").stat().st_ino


@pytest.fixture()
def tiny_fs(tmp_path: Path):
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_preflight_refuses_before_downloading(ckpts: dict[str, Path], server: FaultyHub,
                                              tiny_fs: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    server.stats.reset()
    code = main(["fetch", "repo", FP8_REPO, "--revision", "main", "--dest", str(tiny_fs / "fp8"),
                 "--endpoint", server.url])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "free" in err[0] and str(tiny_fs / "fp8") in err[0]
    assert sum(server.stats.file_bytes.values()) == 0

    with pytest.raises(UserError, match="needs .* free"):
        fetch_fp8_subset(FP8_REPO, "main", ckpts["int4"], tiny_fs / "sub", endpoint=server.url)
    assert _shards(tiny_fs / "sub") == []
    served = sum(n for key, n in server.stats.file_bytes.items() if key.endswith(".safetensors"))
    assert served == _needed(ckpts["fp8"])[1]  # only the headers were read


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.err.strip().splitlines(), out.out


def test_cli_401_and_404(ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("hf_sparkspec_good\n")
    bad.write_text("hf_wrong_token\n")
    good.chmod(0o600)  # a token file others can read is refused
    bad.chmod(0o600)
    with HubServer(ckpts["root"], tokens=["hf_sparkspec_good"]) as srv:
        base = ["fetch", "fp8-subset", FP8_REPO, "--revision", "main", "--int4", str(ckpts["int4"]),
                "--dest", str(tmp_path / "sub"), "--endpoint", srv.url, "--json"]
        for extra in ([], ["--token-file", str(bad)]):
            code, err, out = _cli(capsys, *base, *extra)
            assert (code == 2 and len(err) == 1 and "HF token rejected (401)" in err[0]
                    and FP8_REPO in err[0])
            assert "hf_wrong_token" not in err[0] + out
        code, err, out = _cli(capsys, *base, "--token-file", str(good))
        doc = json.loads(out.strip().splitlines()[-1])
        assert code == 0 and doc["changed"] is True and doc["tensors"] == 6 * SPEC.layers
        assert "hf_sparkspec_good" not in "".join(err) + out
        monkeypatch.setenv("HF_TOKEN", "hf_sparkspec_good")
        code, err, out = _cli(capsys, *base)
        assert code == 0 and json.loads(out.strip().splitlines()[-1])["changed"] is False

        code, err, _ = _cli(capsys, "fetch", "repo", "Qwen/absent", "--revision", "main", "--dest",
                            str(tmp_path / "x"), "--endpoint", srv.url)
        assert code == 2 and len(err) == 1 and "Qwen/absent: repository not found (404)" in err[0]
        monkeypatch.setenv("HF_ENDPOINT", srv.url)  # the mirror setting, no --endpoint
        code, err, _ = _cli(capsys, "fetch", "plan", FP8_REPO, "--revision", "f" * 40)
        assert code == 2 and len(err) == 1 and f"revision {'f' * 40} not found (404)" in err[0]
        code, err, out = _cli(capsys, "fetch", "plan", FP8_REPO, "--revision", "main", "--json")
        plan = json.loads(out.strip().splitlines()[-1])
        assert code == 0 and plan["bytes_needed"] == sum(p.stat().st_size
                                                         for p in ckpts["fp8"].iterdir())
        monkeypatch.delenv("HF_ENDPOINT")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}\n")
    publish(ckpts["root"], "org/no-index", plain)
    with HubServer(ckpts["root"]) as srv:
        code, err, _ = _cli(capsys, "fetch", "fp8-subset", "org/no-index", "--revision", "main",
                            "--int4", str(ckpts["int4"]), "--dest", str(tmp_path / "y"),
                            "--endpoint", srv.url)
        assert (code == 2 and len(err) == 1
                and "model.safetensors.index.json not found (404)" in err[0])


def test_cli_batch_fetches_in_order_in_one_run(ckpts: dict[str, Path], server: FaultyHub,
                                               tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`fetch batch`: the INT4 repo, then the FP8 subset that reads it, in one process; one JSON
    line with each item's result; a re-run changes nothing."""
    publish(ckpts["root"], "Qwen/tiny-int4", ckpts["int4"])
    int4, sub = str(tmp_path / "int4"), str(tmp_path / "sub")
    items = [["repo", "Qwen/tiny-int4", "--revision", "main", "--dest", int4,
              "--endpoint", server.url],
             ["fp8-subset", FP8_REPO, "--revision", "main", "--int4", int4, "--dest", sub,
              "--endpoint", server.url]]
    for changed in (True, False):
        code, err, out = _cli(capsys, "fetch", "batch", "--json", "--items", json.dumps(items))
        doc = json.loads(out.strip().splitlines()[-1])
        assert code == 0 and doc["changed"] is changed, err
        assert [r["repo"] for r in doc["results"]] == ["Qwen/tiny-int4", FP8_REPO]
        assert [r["changed"] for r in doc["results"]] == [changed, changed]
        assert doc["results"][1]["tensors"] == 6 * SPEC.layers
        assert [line.split(":")[1].split("@")[0].strip()
                for line in err if line.startswith("fetch: ")] == \
            ["Qwen/tiny-int4", "24 FP8 tensors of Qwen/tiny-FP8"]
    assert sorted(_shards(tmp_path / "int4")) == sorted(_shards(ckpts["int4"]))


@pytest.mark.parametrize(("items", "message"), [
    ("[]", "--items: not a JSON list of 1-256 argument lists"),
    ('[["repo"], "x"]', "--items: not a JSON list of 1-256 argument lists"),
    ('{"repo": 1}', "--items: not a JSON list of 1-256 argument lists"),
    ('[["plan", "a/b", "--revision", "main"]]',
     "--items: item 1 is 'plan'; each item is a `fetch repo`"),
    ('[["repo", "Qwen/tiny-FP8", "--revision", "main", "--dest", "/tmp/ok", "--endpoint", "EP"], '
     '["repo", "a/../b", "--revision", "main", "--dest", "/tmp/x"]]',
     "fetch batch item 2 repo: argument repo: "),
    ('[["repo", "a/b", "--revision", "main", "--dest", "/tmp/x", "--progress-file=/etc/passwd"]]',
     "--items: item 1 sets --progress-file, which is the batch's own"),
    ('[["fp8-subset", "a/b", "--revision", "main", "--int4", "/x", "--dest", "/y", '
     '"--fp8-pattern", "("]]', "--fp8-pattern"),
], ids=["empty", "not-lists", "object", "other-command", "bad-repo-second", "own-option",
        "bad-pattern"])
def test_cli_batch_refuses_bad_items_before_any_fetch(server: FaultyHub, tmp_path: Path, items: str,
                                                      message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    server.reset()
    items = items.replace("/tmp/", f"{tmp_path}/").replace('"EP"', json.dumps(server.url))
    try:
        code, err, out = _cli(capsys, "fetch", "batch", "--json", "--items", items)
    except SystemExit as exc:   # argparse's own refusal of --items, with the project's one line
        code, captured = exc.code, capsys.readouterr()
        err, out = captured.err.strip().splitlines(), captured.out
    assert code == 2 and len(err) == 1 and message in err[0] and not out, err
    # refused before the first item ran
    assert server.requests == [] and not list(tmp_path.iterdir())
