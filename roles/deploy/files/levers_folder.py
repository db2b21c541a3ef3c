"""Check that a levers plugin folder is whole: exit 0 when every file its dist-info RECORD lists has
the recorded sha256 and size, 1 with one line otherwise (run by the deploy role with the tools
venv's Python).

Usage: python3 levers_folder.py DIR PACKAGE
"""

import base64
import csv
import hashlib
import pathlib
import sys


def problem(folder, package):
    records = sorted(folder.glob(f"{package}-*.dist-info/RECORD")) if folder.is_dir() else []
    if len(records) != 1:
        return f"{folder}: {len(records)} {package} dist-info RECORDs, expected 1"
    rows = list(csv.reader(records[0].read_text().splitlines()))
    if not any(row and row[0] == f"{package}/__init__.py" for row in rows):
        return f"{records[0]}: does not list {package}/__init__.py"
    for row in rows:
        if len(row) < 3 or not row[1]:
            continue   # the RECORD itself, and files pip adds without a hash
        path = folder / row[0]
        algorithm, _, want = row[1].partition("=")
        if algorithm != "sha256" or ".." in pathlib.PurePosixPath(row[0]).parts:
            return f"{records[0]}: unexpected entry {row[0]!r}"
        try:
            data = path.read_bytes()
        except OSError as exc:
            return f"{path}: {exc.strerror}"
        got = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if got != want or (row[2] and int(row[2]) != len(data)):
            return f"{path}: not the file the plugin's RECORD names"
    return None


if __name__ == "__main__":
    why = problem(pathlib.Path(sys.argv[1]), sys.argv[2])
    if why:
        print(why)
    sys.exit(1 if why else 0)
