"""The package as users install it: one `relight` namespace in site-packages, entry points
that name it, every module of the repository's package folders inside it, and the public
API importable from the wheel alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"relight": "relight", "storage": "relight/storage", "ckpt": "relight/ckpt",
                "elastic": "relight/elastic", "runtime": "relight/runtime",
                "chaos": "relight/chaos", "benchmarks": "relight/benchmarks"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources (the checkout gets no build files)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in PACKAGE_DIRS:
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-q", "-w", str(out), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (path,) = out.glob("relight-*.whl")
    return path


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    dist_info = [t for t in top if t.endswith(".dist-info")]
    assert len(dist_info) == 1 and dist_info[0].startswith("relight-"), top
    assert top == {"relight", *dist_info}, top


def test_every_module_of_the_package_folders_is_in_the_wheel(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"{installed}/{py.relative_to(ROOT / folder).as_posix()}"
                for folder, installed in PACKAGE_DIRS.items()
                for py in (ROOT / folder).rglob("*.py") if "__pycache__" not in py.parts}
    assert expected - names == set()
    assert not any(n.startswith("relight/benchmarks/results/") for n in names)


def test_entry_points_name_the_namespace(wheel: Path) -> None:
    zf = zipfile.ZipFile(wheel)
    (ep,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = zf.read(ep).decode()
    assert "relight = relight.cli:main" in text
    assert "relight-etcd = relight.elastic.rendezvous:torchrun_handler" in text


def test_the_installed_wheel_gives_the_public_api(wheel: Path, tmp_path: Path) -> None:
    """Unpacked alone on the path (the checkout's editable finder comes after it), run from
    a directory with none of the repository's folders."""
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = ("import relight, sys, pydoc\n"
            "import relight.storage\n"
            "print('torch' in sys.modules)\n"
            "print(relight.__file__)\n"
            "print(relight.ckpt.__file__)\n"
            "print(relight.CheckpointManager.__module__, relight.ReplicaManager.__module__)\n"
            "print(issubclass(relight.ckpt.CheckpointError, relight.RelightError))\n"
            "text = pydoc.render_doc(relight, renderer=pydoc.plaintext)\n"
            "print(all(name in text for name in relight.__all__ if name != '__version__'))\n"
            "print(relight.__version__ in text.split('VERSION', 1)[1][:40])\n"
            "print(relight.__version__)\n"
            "for old in ('runtime', 'ckpt', 'elastic', 'storage', 'chaos', 'benchmarks'):\n"
            "    try:\n"
            "        __import__(old)\n"
            "    except ModuleNotFoundError:\n"
            "        continue\n"
            "    print('importable:', old)\n")
    env = {**os.environ, "PYTHONPATH": str(target)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0] == "False"  # the storage door does not pay for torch
    assert lines[1].startswith(str(target)) and lines[2].startswith(str(target))
    assert lines[3:7] == ["relight.ckpt.manager relight.elastic.replica", "True", "True", "True"]
    assert wheel.name.startswith(f"relight-{lines[7]}-")  # __version__ is the wheel's
    assert lines[8:] == []  # none of the old top-level names imports
