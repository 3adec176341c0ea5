"""The quickstart notebook as a Jupyter notebook: Databricks source -> percent format -> .ipynb
(jupytext), executed cell by cell on a real IPython kernel (nbclient) running this interpreter."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.notebook import databricks_to_percent

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "01_quickstart.py"
KERNEL = "shardline-tests"


def test_databricks_source_converts_to_cells():
    jupytext = pytest.importorskip("jupytext")
    notebook = jupytext.reads(databricks_to_percent(NOTEBOOK.read_text()), fmt="py:percent")
    kinds = [cell.cell_type for cell in notebook.cells]
    assert kinds[0] == "markdown" and notebook.cells[0].source.startswith("# shardline quickstart")
    assert kinds.count("markdown") == 3 and kinds.count("code") == 4
    assert not any("COMMAND ----------" in cell.source or "MAGIC" in cell.source for cell in notebook.cells)


def test_magic_cells_other_than_markdown_stay_commented_code():
    text = ("# Databricks notebook source\nx = 1\n\n# COMMAND ----------\n\n# MAGIC %sh ls\n\n"
            "# COMMAND ----------\n\n# MAGIC %md\n# MAGIC ## Title\n# MAGIC body\n")
    assert databricks_to_percent(text) == "# %%\nx = 1\n\n# %%\n# MAGIC %sh ls\n\n# %% [markdown]\n# ## Title\n# body\n"


@pytest.mark.slow
def test_quickstart_executes_as_ipynb_on_a_kernel(tmp_path, monkeypatch, notebook_env, printed_metrics):
    jupytext = pytest.importorskip("jupytext")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    kernelspec = pytest.importorskip("ipykernel.kernelspec")
    path = tmp_path / "01_quickstart.ipynb"
    jupytext.write(jupytext.reads(databricks_to_percent(NOTEBOOK.read_text()), fmt="py:percent"), path)
    # A kernel spec for this interpreter (the venv's python + its ipykernel), found only by this test.
    prefix = tmp_path / "jupyter"
    kernelspec.install(prefix=str(prefix), kernel_name=KERNEL, display_name="shardline tests")
    for name, folder in {"JUPYTER_PATH": prefix / "share" / "jupyter", "JUPYTER_DATA_DIR": tmp_path / "data",
                         "JUPYTER_RUNTIME_DIR": tmp_path / "runtime", "IPYTHONDIR": tmp_path / "ipython"}.items():
        monkeypatch.setenv(name, str(folder))

    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, kernel_name=KERNEL, timeout=300,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=notebook_env())  # the kernel's environment: widgets, PYSPARK_PYTHON, JUPYTER_*
    nbformat.write(notebook, tmp_path / "01_quickstart.executed.ipynb")

    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    stdout = "".join(output.text for output in outputs if output.output_type == "stream" and output.name == "stdout")
    assert "mlflow run id:" in stdout
    # The live step bar is a tqdm widget in a notebook, not text lines with carriage returns.
    widgets = [output for output in outputs if output.output_type == "display_data"
               and "application/vnd.jupyter.widget-view+json" in output.get("data", {})]
    assert widgets, f"no widget output among {[output.output_type for output in outputs]}"
    assert any("training" in output["data"].get("text/plain", "") for output in widgets)
    assert "\r" not in stdout
    metrics = printed_metrics(stdout)
    assert set(metrics) >= {"loss", "accuracy", "macro_f1"} and metrics["accuracy"] > 0.8
