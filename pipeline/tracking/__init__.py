"""MLflow tracking for shardline runs. The only module that imports mlflow (lazily, inside functions)."""
from pipeline.tracking.params import flatten_params
from pipeline.tracking.run import TrackedRun, TrackingError, active_run_store, start_run
from pipeline.tracking.uri import resolve_tracking_uri, tracking_uri_of

__all__ = ["TrackedRun", "TrackingError", "active_run_store", "flatten_params", "resolve_tracking_uri", "start_run",
           "tracking_uri_of"]
