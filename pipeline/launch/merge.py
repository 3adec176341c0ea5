"""Driver side: the merged model of a finished run, from the PS state or from the replicas' result rows."""
from __future__ import annotations

from pipeline.errors import WorkerTrainingFailedError
from pipeline.models import ModelSpec


def replica_parameters(rows: list[dict], num_params: int, stages: int = 1):
    """allreduce: rank 0's parameters, after checking that every replica ended bit-identical. With pipeline
    stages, each stage's replica 0 (rank = stage) returns its slice; they are concatenated."""
    import torch

    for stage in range(stages):
        digests = {r["rank"]: r["parameters_digest"] for r in rows if r["rank"] % stages == stage}
        if len(set(digests.values())) != 1:
            raise WorkerTrainingFailedError({}, cause=f"the allreduce replicas disagree at the end (sha256 by rank: "
                                                      f"{digests}); this is a bug, please report it")
    raw = b"".join(bytes(next(r["parameters"] for r in rows if r["rank"] == stage)) for stage in range(stages))
    flat = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    if flat.numel() != num_params:
        raise WorkerTrainingFailedError({}, cause=f"rank 0 returned {flat.numel()} parameters, the model has "
                                                  f"{num_params}")
    return flat


def replica_buffers(rows: list[dict], num_words: int, stages: int = 1):
    """allreduce: replica 0's buffers (each stage's, concatenated in stage order). The flat backend's DDP
    broadcasts rank 0's buffers to every replica before each forward, so they are the ones every replica
    trained with; the replicas' own copies differ by their last batch, and are not compared."""
    import torch

    raw = b"".join(bytes(next(r.get("buffers") or b"" for r in rows if r["rank"] == stage)) for stage in range(stages))
    flat = torch.frombuffer(bytearray(raw), dtype=torch.float32) if raw else torch.empty(0)
    if flat.numel() != num_words:
        raise WorkerTrainingFailedError({}, cause=f"replica 0 returned {flat.numel()} buffer words, the model's "
                                                  f"buffers take {num_words}")
    return flat


def task_ps_buffers(rows: list[dict], num_words: int):
    """ps.placement=task with the PS backend: the merged buffers rank 0's parameter server returned."""
    return replica_buffers([r for r in rows if r["rank"] == 0], num_words, 1)


def replica_outcome(rows: list[dict], num_params: int, stages: int, planned_steps: int):
    """allreduce: (merged parameters, steps every replica ran, the steps planned)."""
    return replica_parameters(rows, num_params, stages), min(r["steps"] for r in rows), planned_steps


def task_ps_parameters(rows: list[dict], num_params: int):
    """ps.placement=task with the PS backend: the final PS parameters rank 0's task returned."""
    import torch

    flat = torch.frombuffer(bytearray(next(r["parameters"] for r in rows if r["rank"] == 0)), dtype=torch.float32)
    if flat.numel() != num_params:
        raise WorkerTrainingFailedError({}, cause=f"rank 0's parameter server returned {flat.numel()} parameters, "
                                                  f"the model has {num_params}")
    return flat


def check_steps(version: int, expected: int) -> None:
    """Every planned step was applied, or the run failed (a merged model of a partial run is refused)."""
    if version != expected:
        raise WorkerTrainingFailedError({}, cause=f"training applied {version} steps, expected {expected}")


def merged_model(spec: ModelSpec, parameters):
    """A fresh module holding the final flat parameters, in eval mode."""
    from pipeline.models import build_model, load_flat_state

    model = build_model(spec)
    load_flat_state(model, parameters)
    model.eval()
    return model
