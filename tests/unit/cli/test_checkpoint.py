"""The ``sparkspec checkpoint`` command line (sparkspec.cli.checkpoint): every flag fed bad
values."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from sparkspec.checkpoint.selection import EXTRA_FILE
from tests.badinput import refused_untouched
from tests.unit.conftest import Tree

# Every flag of ``sparkspec checkpoint assemble|add-mtp|verify|generate`` fed bad values (the files
# they read: test_checkpoint_badinput.py). Each case asserts the exact outcome through
# tests.badinput: exit 2, exactly one line ``sparkspec: error: ...`` matching the case's regex, no
# traceback, and every folder involved unchanged by content hash (nothing written, nothing left
# behind).


# --- flags ----------------------------------------------------------------------------------------
NUMBERS = {"nan": "nan", "inf": "inf", "negative": "-1", "huge": "99999999999", "float": "1.5",
           "word": "many"}


def _flag_cases() -> list[Any]:
    cases = []
    for flag, action in (("--expect-fp8", "assemble"), ("--expect-mtp", "verify")):
        for kind, value in NUMBERS.items():
            cases.append(pytest.param(action, flag, value, rf"argument {flag}: ",
                                      id=f"{action}{flag}={kind}"))
    bounds = {"--hidden": ("0", "100", "8320"), "--layers": ("0", "129"),
              "--experts": ("0", "1", "513"), "--shared-intermediate": ("0", "130", "8320"),
              "--mtp-layers": ("5",), "--shards": ("0", "257")}
    for flag, special in bounds.items():
        for kind, value in [*NUMBERS.items(), *((f"edge{v}", v) for v in special)]:
            cases.append(pytest.param("generate", flag, value, rf"argument {flag}: ",
                                      id=f"generate{flag}={kind}"))
    for flag, value in (("--kind", "int8"), ("--scale-dtype", "F16")):
        cases.append(pytest.param("generate", flag, value, rf"argument {flag}: invalid choice",
                                  id=f"generate{flag}={value}"))
    return cases


@pytest.mark.parametrize("action, flag, value, match", _flag_cases())
def test_bad_number_or_choice_flag(ckpt_tree: Tree, action: str, flag: str, value: str,
                                   match: str) -> None:
    argv: list[str | Path]
    if action == "assemble":
        argv = [*ckpt_tree.assemble(), flag, value]
    elif action == "verify":
        argv = ["checkpoint", "verify", ckpt_tree.int4, "--no-load", flag, value]
    else:
        argv = ["checkpoint", "generate", "--kind", "int4", "--out", ckpt_tree.root / "gen",
                flag, value]
        if flag == "--kind":
            argv = ["checkpoint", "generate", "--out", ckpt_tree.root / "gen", flag, value]
    refused_untouched(argv, [ckpt_tree.root], match=match)


PATH_CASES: list[tuple[str, str, str, str]] = [
    # (id, command, which path flag gets the bad value, match)
    ("missing", "assemble --int4", "missing", r"--int4 .*absent: not a folder"),
    ("file", "assemble --int4", "file", r"--int4 .*notes.txt: not a folder"),
    ("fifo", "assemble --fp8", "fifo", r"--fp8 .*pipe: not a folder"),
    ("missing", "add-mtp --source", "missing", r"--source .*absent: not a folder"),
    ("no_head", "add-mtp --source", "empty", rf"{EXTRA_FILE}: not found"),
    ("file", "add-mtp --target", "file", r"--target .*: not a folder"),
    ("foreign", "add-mtp --target", "foreign", r"was not written by sparkspec checkpoint assemble"),
    ("missing", "verify", "missing", r"not a directory"),
    ("fifo", "verify", "fifo", r"not a directory"),
    ("empty_folder", "verify", "empty", r"index not found"),
    ("file", "generate --out", "file", r"--out .* not a folder"),
    ("foreign", "generate --out", "foreign",
     r"was not written by python -m tests.support checkpoint generate"),
    ("file_parent", "assemble --out", "under_file", r"--out .*: .*notes.txt is not a folder"),
    ("foreign", "assemble --out", "foreign", r"was not written by sparkspec checkpoint assemble"),
    ("empty_string", "assemble --out", "", r"--out .* contains the input --int4"),
]


@pytest.mark.parametrize("case, command, bad, match", PATH_CASES,
                         ids=[f"{c[1]}={c[0]}" for c in PATH_CASES])
def test_bad_path_flag(ckpt_tree: Tree, case: str, command: str, bad: str, match: str,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ckpt_tree.root)  # '' is the current folder: the one holding the sources
    value: str | Path = {"missing": ckpt_tree.root / "absent", "file": ckpt_tree.root / "notes.txt",
                         "fifo": ckpt_tree.root / "pipe", "empty": ckpt_tree.root / "empty",
                         "foreign": ckpt_tree.root / "mine",
                         "under_file": ckpt_tree.root / "notes.txt" / "out", "": ""}[bad]
    (ckpt_tree.root / "notes.txt").write_text("notes")
    os.mkfifo(ckpt_tree.root / "pipe")
    (ckpt_tree.root / "empty").mkdir()
    (ckpt_tree.root / "mine").mkdir()
    (ckpt_tree.root / "mine" / "keep.txt").write_text("mine")
    action, _, flag = command.partition(" ")
    if action == "add-mtp":
        ckpt_tree.hybrid(mtp=False)
    if action == "assemble":
        args = {"--int4": ckpt_tree.int4, "--fp8": ckpt_tree.fp8, "--out": ckpt_tree.out,
                flag: value}
        argv = ["checkpoint", "assemble", *[x for kv in args.items() for x in kv]]
    elif action == "add-mtp":
        args = {"--source": ckpt_tree.int4, "--target": ckpt_tree.out, flag: value}
        argv = ["checkpoint", "add-mtp", *[x for kv in args.items() for x in kv]]
    elif action == "verify":
        argv = ["checkpoint", "verify", value, "--no-load"]
    else:
        argv = ["checkpoint", "generate", "--kind", "fp8", "--out", value]
    refused_untouched(argv, [ckpt_tree.root], match=match)


def test_bad_fp8_pattern(ckpt_tree: Tree) -> None:
    refused_untouched([*ckpt_tree.assemble(), "--fp8-pattern", "(unclosed"], [ckpt_tree.root],
                      match=r"--fp8-pattern '\(unclosed': not a valid regular expression")
