"""The docs site: built by MkDocs in strict mode (a broken link or a page missing from the nav fails), with a
configuration reference and a troubleshooting page generated from the code and complete."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools import docs_gen  # noqa: E402


def test_every_config_key_has_a_type_a_default_and_a_meaning():
    rows = list(docs_gen.config_keys())
    keys = {row["key"] for row in rows}
    assert {"train.lr", "ps.mode", "data.features[type: categorical].hash_buckets", "tune.space"} <= keys
    assert [row["key"] for row in rows if not row["meaning"]] == []  # a new key needs its comment
    lr = next(row for row in rows if row["key"] == "train.lr")
    assert lr["type"] == "float" and lr["default"] == "0.05" and "learning rate" in lr["meaning"]


def test_a_key_without_a_comment_is_caught():
    from pipeline.config.section import Section

    class Undocumented(Section):
        explained: int = 1  # this one says what it is
        silent: int = 2

    rows = {row["key"]: row["meaning"] for row in docs_gen.config_keys(Undocumented)}
    assert rows == {"explained": "this one says what it is", "silent": ""}


def test_every_error_type_has_a_troubleshooting_entry():
    assert docs_gen.missing() == {"undocumented": [], "stale": [], "incomplete": []}
    names = set(docs_gen.error_types())
    assert {"pipeline.errors.ConfigError", "pipeline.errors.WorkerTrainingFailedError"} <= names


def test_an_error_type_without_an_entry_is_caught(monkeypatch):
    from pipeline import errors

    class BrandNewError(errors.ShardlineError):
        pass

    BrandNewError.__module__, BrandNewError.__qualname__ = "pipeline.errors", "BrandNewError"  # as if it had grown one
    assert "pipeline.errors.BrandNewError" in docs_gen.missing()["undocumented"]


def _sources(tmp_path) -> Path:
    """A copy of docs/ and mkdocs.yml with the generated pages in it (the checkout stays untouched)."""
    site_src = tmp_path / "src"
    shutil.copytree(REPO / "docs", site_src / "docs", ignore=shutil.ignore_patterns("generated"))
    shutil.copy(REPO / "mkdocs.yml", site_src / "mkdocs.yml")
    docs_gen.generate(site_src / "docs" / "generated")
    return site_src


def _build(site_src: Path, out: Path) -> subprocess.CompletedProcess:
    # Not -q: strict mode counts the warnings it logs, and a quiet build logs none.
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=site_src,
                          capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_the_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs")
    proc = _build(_sources(tmp_path), tmp_path / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = tmp_path / "site"
    reference = (site / "generated" / "config-reference" / "index.html").read_text()
    assert "ps.mode" in reference and "tune.space" in reference
    assert "WorkerTrainingFailedError" in (site / "generated" / "troubleshooting" / "index.html").read_text()
    assert "tracked_training" in (site / "api" / "index.html").read_text()  # docstrings rendered


def test_a_broken_link_fails_the_strict_build(tmp_path):
    pytest.importorskip("mkdocs")
    site_src = _sources(tmp_path)
    page = site_src / "docs" / "quickstart.md"
    page.write_text(page.read_text() + "\nSee [the missing page](nowhere.md).\n")
    proc = _build(site_src, tmp_path / "site")
    assert proc.returncode != 0 and "nowhere.md" in proc.stdout + proc.stderr


def test_make_docs_serves_the_site_on_loopback(tmp_path):
    """`make docs` generates the pages and serves them on 127.0.0.1 (DOCS_ADDR; never a wildcard)."""
    import socket
    import time
    import urllib.request

    pytest.importorskip("mkdocs")
    if not (REPO / ".venv" / ".installed-stamp").exists():
        pytest.skip("make docs needs the installed .venv (make install)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(["make", "-s", "docs", f"DOCS_ADDR=127.0.0.1:{port}"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, page = time.monotonic() + 120, None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as response:
                    page = response.read().decode()
                break
            except OSError:
                time.sleep(0.5)
        assert page is not None, f"make docs served nothing within 120 s:\n{server.stdout.read1(20000).decode()}"
        assert "shardline" in page and "Quickstart" in page
    finally:
        import os
        import signal

        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
