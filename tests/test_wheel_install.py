"""runnx installed from a wheel where its user cannot write (a read-only site-packages, run as
`nobody` when the tests run as root), run from another folder: numba caches the kernels under
RUNNX_CACHE, nothing lands in the install, and a second process loads them all (compiles nothing).

Marked `wheel_install` (deselect with -m "not wheel_install"): it builds a wheel, makes a venv and
compiles the tiny Llama's kernels from an empty cache, about half a minute on two idle cores.
"""
from __future__ import annotations

import os
import pwd
import re
import shutil
import site
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "fixtures" / "tiny-llama" / "model.onnx"
pytestmark = pytest.mark.wheel_install


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=900, **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


def as_unprivileged() -> list[str]:
    """A prefix running a command as `nobody` when this is root (root writes anywhere)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        nobody = None
    if setpriv is None or nobody is None:
        pytest.skip("running as root without setpriv or a `nobody` user: no user without write access")
    return [setpriv, f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]


def make_venv(base: Path) -> tuple[Path, Path]:
    """A fresh venv (its python, its site-packages) seeing this one's packages through a .pth
    file after its own: runnx's dependencies without installing them."""
    venv = base / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    ours = [path for path in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]} if Path(path).is_dir()]
    (purelib / "dependencies.pth").write_text("\n".join(ours) + "\n")
    return python, purelib


def numba_files(folder: Path) -> dict[str, float]:
    return {str(path.relative_to(folder)): path.stat().st_mtime for path in folder.rglob("*")
            if path.suffix in (".nbi", ".nbc")}


def outputs(report: str) -> list[str]:
    """The output lines of `runnx run` (name, shape, statistics), without numba's cache messages,
    which a thread loading kernels ahead (ops/kernel_loads.py) may print inside a line, before it
    or after it: each message alone is removed (numba prints it and its newline in two writes, so
    an output line may follow a message on its line)."""
    report = re.sub(r"\[cache\] (?:index|data) (?:loaded from|saved to) '[^']*'", "", report)
    return [line for line in report.splitlines() if line.startswith(("  logits", "  present."))]


@pytest.fixture
def base():
    """A folder `nobody` can read (pytest's tmp_path is private to its user); removed after."""
    folder = Path(tempfile.mkdtemp(prefix="runnx-wheel-"))
    folder.chmod(0o755)
    yield folder
    for path in folder.rglob("*"):  # the test made the install read-only
        if path.is_dir() and not path.is_symlink():
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    shutil.rmtree(folder, ignore_errors=True)


def test_a_read_only_wheel_install_caches_kernels_under_runnx_cache(base):
    prefix = as_unprivileged()
    source = base / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "runnx", source / "runnx", ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", base / "wheel", source])
    wheel = next((base / "wheel").glob("runnx-*.whl"))

    python, purelib = make_venv(base)
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel])
    installed = purelib / "runnx"
    for path in [installed, *installed.rglob("*")]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))

    cache, cwd = base / "cache", base / "elsewhere"
    for folder in (cache, cwd):
        folder.mkdir(mode=0o777)
        folder.chmod(0o777)
    model = shutil.copy(MODEL, cwd / "model.onnx")  # readable by `nobody` wherever this checkout is
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "NUMBA_CACHE_DIR") and not key.startswith("VIRTUAL_ENV")}
    env.update(RUNNX_CACHE=str(cache), NUMBA_DEBUG_CACHE="1", HOME=str(cwd))

    if prefix and subprocess.run([*prefix, python, "-c", "import numpy, numba"], cwd=cwd, env=env,
                                 capture_output=True).returncode != 0:
        # this checkout's venv (the wheel's dependencies) lies in a folder `nobody` cannot enter:
        # run as this user; the install is still never written (checked below), its caches still
        # go to RUNNX_CACHE, which is what a read-only install needs
        prefix = []
    where = run([*prefix, python, "-c", "import runnx; print(runnx.__file__)"], cwd=cwd, env=env).stdout.strip()
    assert Path(where).parent == installed, "the wheel's runnx, not this checkout's"
    first = run([*prefix, base / "venv" / "bin" / "runnx", "run", model], cwd=cwd, env=env).stdout
    assert "logits" in first and "[cache] data saved to" in first
    cached = numba_files(cache)
    folders = {Path(name).parts[:2] for name in cached}
    assert len(folders) == 1 and next(iter(folders))[0] == "numba", folders
    assert any(name.endswith(".nbc") for name in cached) and any(name.endswith(".nbi") for name in cached)
    assert numba_files(installed) == {} and numba_files(source) == {}

    second = run([*prefix, base / "venv" / "bin" / "runnx", "run", model], cwd=cwd, env=env).stdout
    assert "[cache] data loaded from" in second
    assert "saved to" not in second, "the second process compiled (and saved) a kernel again"
    assert numba_files(cache) == cached
    assert outputs(second) == outputs(first) != []
