"""bench/device_scaling.sh: a script for a machine this suite never runs on, so what can be checked here is:
it parses, it refuses an unknown verb, and every wheel `prepare` fetches is pinned in constraints/modern.txt
(a name that matches no line, or two, would break `prepare` or carry the wrong version)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_scaling.sh"


def test_the_script_parses_and_refuses_an_unknown_verb():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    done = subprocess.run(["bash", str(SCRIPT), "measure"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage: bash bench/device_scaling.sh prepare|run" in done.stderr


def test_every_wheel_prepare_fetches_is_pinned_once_in_the_constraints():
    names = re.search(r"for name in ([^;]+); do", SCRIPT.read_text()).group(1).split()
    assert "pydantic" in names and "pydantic_core" in names
    pins = (ROOT / "constraints" / "modern.txt").read_text().splitlines()
    for name in names:
        pattern = re.compile("^" + re.sub(r"[-_]", "[-_]", name) + "==", re.IGNORECASE)
        assert len([line for line in pins if pattern.match(line)]) == 1, name
