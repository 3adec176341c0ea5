"""Every notebook (notebooks/0*.py) runs as a plain script on a small config, in its own process."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("0*.py"))

# Per notebook: widget values on top of the common ones, and lines its output must contain.
WIDGETS = {"04_parallelism_modes": {"epochs": "1"}, "05_tune": {"trials": "2"}}
EXPECTED = {
    "01_quickstart": ["mlflow run id:", "test metrics:"],
    "02_custom_model": ["ResidualBlock", "model: models:/", "test metrics:"],
    "03_evaluate_and_promote": ["test metrics:", "-> champion", "reason: no champion yet"],
    "04_parallelism_modes": ["samples_per_s", "val_accuracy", *(f"\n{mode} " for mode in
                                                               ("sync", "async", "ssp", "average", "allreduce",
                                                                "pipeline"))],
    "05_tune": ["study digits-tune: 2 trials", "mlflow run id:", "best value:", "best.yaml"],
}


def test_there_are_five_notebooks():
    assert [path.stem for path in NOTEBOOKS] == list(EXPECTED)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_is_databricks_source_format(path):
    text = path.read_text()
    assert text.startswith("# Databricks notebook source\n")
    assert text.count("\n# COMMAND ----------\n") >= 3
    assert "# MAGIC %md" in text
    assert "from pipeline.notebook import widget" in text


# 01_quickstart runs as a script in tests/docs/test_quickstart.py (the docs' notebook block) and on a
# Jupyter kernel in test_quickstart.py here: a third run would add a minute and no coverage.
@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem != "01_quickstart"], ids=lambda path: path.stem)
def test_notebook_runs_as_a_script(path, tmp_path, notebook_env, printed_metrics):
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=notebook_env(**WIDGETS.get(path.stem, {})),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    output = proc.stdout
    assert proc.returncode == 0, f"{path.name} exited {proc.returncode}:\n{output[-6000:]}"
    for expected in EXPECTED[path.stem]:
        assert expected in output, f"{path.name} did not print {expected!r}:\n{output[-6000:]}"
    if "test metrics:" in EXPECTED[path.stem]:
        assert printed_metrics(output)["accuracy"] > 0.8
    assert (tmp_path / "mlflow.db").exists()
