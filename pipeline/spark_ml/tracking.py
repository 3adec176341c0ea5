"""Whether ``ShardlineEstimator.fit`` logs an MLflow run, and into which store and experiment.

A fit logs (params, per-epoch metrics, test metrics, the served model: the same run the ``steps`` entry
points write) when the user has asked for tracking in any of the usual ways:
- an MLflow run is active (``with mlflow.start_run(): cv.fit(df)``): the fit's run is nested under it, in
  its tracking store and experiment, so every fit of a ``pyspark.ml.tuning`` search shows under the
  search's run;
- the estimator's config sets ``tracking.uri`` (``configPath`` or ``overrides``);
- ``MLFLOW_TRACKING_URI`` is set (Databricks sets it in every notebook). ``mlflow.set_tracking_uri``
  exports it too, so a session that already tracked a ``steps`` run keeps tracking its fits.
Otherwise a fit stays out of MLflow, as before: a Spark ML stage has no side effects nobody asked for.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

log = logging.getLogger(__name__)


def current_run() -> Optional[tuple[str, str, str]]:
    """The MLflow run active on this thread, as plain values (uri, experiment, run id); None without one.
    Cheap when MLflow was never imported: then no run can be active."""
    if "mlflow" not in sys.modules:
        return None
    from pipeline.tracking import active_run_store

    return active_run_store()


def tracking_overlay(explicit_uri: bool, inherited: Optional[tuple[str, str, str]] = None
                     ) -> tuple[Optional[dict], dict]:
    """(overlay, tags): overlay None means the fit does not log, else a config overlay (possibly empty) for
    its run; tags go on that run. ``inherited`` is the run that was active when the estimator was copied:
    pyspark.ml.tuning copies the estimator on the caller's thread and fits the copies on a thread pool,
    where MLflow (whose active run is per thread) sees none — the child names its parent by tag then."""
    active = current_run()
    parent = active or inherited
    if parent is not None:
        uri, experiment, run_id = parent
        log.info("fit logs a run nested under the MLflow run %s (experiment %s)", run_id, experiment)
        tags = {} if active is not None else {"mlflow.parentRunId": run_id}
        return {"tracking": {"uri": uri, "experiment": experiment}}, tags
    if explicit_uri or os.environ.get("MLFLOW_TRACKING_URI", "").strip():
        return {}, {}
    return None, {}
