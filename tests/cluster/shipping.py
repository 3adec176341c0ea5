"""How the code reaches the testbed's executors, as on a real cluster: an interpreter with shardline's
dependencies but not shardline itself, and the project's wheel for spark-submit's --py-files."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def make_executor_python(python: str, folder: Path) -> str:
    """A venv with the driver venv's packages but without its `pipeline`: the driver venv's site-packages
    joins sys.path as a plain folder, so its .pth files (the editable install's finder) are not run, and
    `import pipeline` works only from what spark-submit ships, as on a cluster whose image lacks it."""
    if not (folder / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", "--without-pip", str(folder)], check=True, capture_output=True)
    site = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()
    own = subprocess.check_output([str(folder / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    Path(own, "driver-venv-packages.pth").write_text(site + "\n")
    probe = subprocess.run([str(folder / "bin" / "python"), "-c", "import pipeline"], capture_output=True, text=True,
                           cwd=folder)
    if probe.returncode == 0:
        raise RuntimeError(f"the executor interpreter {folder} imports pipeline without the shipped wheel")
    return str(folder / "bin" / "python")


def build_wheel(dist: Path) -> Path:
    """The project's wheel, built from a copy of the package sources (an in-tree build/ could carry modules
    deleted since) as `pip wheel` or `python -m build` makes it, under a .zip name for --py-files: a wheel is
    a zip, but PySpark puts only .zip, .egg and .jar files on the executors' sys.path (a .whl reaches the
    driver's path only, and the executors fail on `No module named 'udfs'`)."""
    dist.mkdir(parents=True, exist_ok=True)
    for old in [*dist.glob("*.whl"), *dist.glob("*.zip")]:
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="sl-wheel-") as tmp:
        for name in ("pipeline", "udfs"):
            shutil.copytree(REPO / name, Path(tmp, name), ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(REPO / name, tmp)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(dist), tmp], check=True, capture_output=True)
    wheel = next(dist.glob("shardline-*.whl"))
    return Path(shutil.copy(wheel, dist / "shardline.zip"))
