"""The per-architecture registry (top-level ``patches/``) is ``hf_alibi.patches`` wherever hf_alibi runs:
from a source checkout (this test run), and in a built wheel, never as a top-level ``patches``."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import hf_alibi.patches.rotary  # (binds hf_alibi.patches too)

ROOT = Path(__file__).resolve().parents[2]


def test_a_source_checkout_reads_the_rows_from_the_top_level_patches_folder():
    assert [Path(p).resolve() for p in hf_alibi.patches.__path__] == [ROOT / "patches"]
    assert Path(hf_alibi.patches.rotary.__file__).resolve() == ROOT / "patches" / "rotary.py"


def test_the_wheel_ships_patches_as_hf_alibi_patches_and_no_top_level_package(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("hf_alibi", "patches"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    build = "from setuptools import build_meta; print('WHEEL=' + build_meta.build_wheel('dist'))"
    result = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    wheel = src / "dist" / result.stdout.split("WHEEL=")[-1].strip()
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        shipped_init = archive.read("hf_alibi/patches/__init__.py")
        top_level = archive.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode().split()
    rows = sorted(f"hf_alibi/patches/{path.name}" for path in (ROOT / "patches").glob("*.py"))
    assert sorted(n for n in names if "patches" in n) == rows
    assert top_level == ["hf_alibi"]
    # the package is patches/ itself: the source checkout's stand-in (hf_alibi/patches/__init__.py) stays out
    assert shipped_init == (ROOT / "patches" / "__init__.py").read_bytes()
    # and every core file (a checkpoint's remote code) is there
    core = sorted(f"hf_alibi/core/{path.name}" for path in (ROOT / "hf_alibi" / "core").glob("*.py"))
    assert sorted(n for n in names if n.startswith("hf_alibi/core/")) == core
