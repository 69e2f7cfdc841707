"""The first `./dev` installs the project without a page of setuptools warnings, and the built wheel carries the
claims board. The project is built here as pip builds it (setuptools' PEP 517 backend, in a copy of the
sources the build reads), with every warning recorded."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_BUILD = """
import json, sys, warnings
from setuptools import build_meta
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    wheel = build_meta.build_wheel(sys.argv[1])
    editable = build_meta.build_editable(sys.argv[1])
print(json.dumps({
    "wheel": wheel,
    "editable": editable,
    "warnings": [[w.category.__name__, str(w.message)] for w in caught],
}))
"""


def _build(tmp_path: Path) -> dict[str, object]:
    source = tmp_path / "source"
    (source / "clients" / "python").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "coordinator", source / "coordinator", ignore=ignore)
    for package in ("inbox_claims", "inbox_wire"):
        shutil.copytree(ROOT / "clients" / "python" / package, source / "clients" / "python" / package, ignore=ignore)
    result = subprocess.run(
        [sys.executable, "-c", _BUILD, str(tmp_path / "dist")],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    built = json.loads(result.stdout.strip().splitlines()[-1])
    assert isinstance(built, dict)
    return built


def _dev_filter() -> str:
    """The one warning filter `./dev` gives pip's build (PYTHONWARNINGS=ignore:MESSAGE)."""
    found: list[str] = re.findall(r'PYTHONWARNINGS="ignore:([^"]+)"', (ROOT / "dev").read_text())
    assert len(found) == 1, found
    return found[0]


def test_the_build_warns_of_nothing_but_what_dev_filters_as_information(tmp_path: Path) -> None:
    built = _build(tmp_path)
    warnings = built["warnings"]
    assert isinstance(warnings, list)
    # Not the deprecated license table, not "Package would be ignored: coordinator.board".
    left = [(category, message) for category, message in warnings if not message.startswith(_dev_filter())]
    assert left == [], "\n\n".join(f"{category}: {message}" for category, message in left)
    # What the filter hides is setuptools' note on editable installs, information only.
    assert {category for category, _ in warnings} <= {"InformationOnly"}


def test_the_wheel_carries_the_claims_board(tmp_path: Path) -> None:
    built = _build(tmp_path)
    with zipfile.ZipFile(tmp_path / "dist" / str(built["wheel"])) as wheel:
        names = set(wheel.namelist())
    board = {path.name for path in (ROOT / "coordinator" / "api" / "board").iterdir() if path.is_file()}
    assert board, "no board files"
    assert {f"coordinator/api/board/{name}" for name in board} <= names


def test_the_client_packages_carry_no_server_code(tmp_path: Path) -> None:
    """The wire package holds what both sides import (messages, stubs, constants); the Connect code of the HTTP
    face needs the server's dependencies and ships in the coordinator only."""
    built = _build(tmp_path)
    with zipfile.ZipFile(tmp_path / "dist" / str(built["wheel"])) as wheel:
        names = set(wheel.namelist())
    client = {name for name in names if name.startswith(("inbox_claims/", "inbox_wire/"))}
    assert "inbox_wire/v1/coordinator_pb2.py" in client
    assert "inbox_wire/v1/coordinator_pb2_grpc.py" in client
    assert not [name for name in client if "connect" in name.rsplit("/", 1)[-1]]
    assert "coordinator/api/_connect.py" in names
