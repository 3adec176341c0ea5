"""Beside the PS (driver or rank 0's task): what a checkpoint holds — the PS state together with the epoch
reports that belong to it."""
from __future__ import annotations

from pipeline.checkpoints import SnapshotNotReady

__all__ = ["SnapshotNotReady", "epochs_left_unreported", "take_snapshot"]


def epochs_left_unreported(state: dict, reports: dict, consistency, world_size: int, steps_per_epoch: int,
                           epochs: int, offset: int = 0) -> list[tuple[int, int]]:
    """(rank, epoch) pairs the ranks resumed from PS ``state`` would start after, but that ``reports``
    (``EpochProgress.reports()``) does not hold: they would never be reported again. ``offset``: the run's
    step offset (a resume on another world size, pipeline.data.assignment.StreamPlan)."""
    from pipeline.launch.ps_side.progress import unreported_epochs
    from pipeline.ps.modes.consistency import resume_step

    total = offset + steps_per_epoch * epochs
    steps = {rank: resume_step(consistency, state, rank, total) - offset for rank in range(world_size)}
    return unreported_epochs(reports, steps, steps_per_epoch)


def take_snapshot(server, progress, consistency, steps_per_epoch: int, epochs: int, /, probe: dict | None = None,
                  **meta) -> dict:
    """``{"step", "ps", "history", "pending", **meta}``, or SnapshotNotReady (retry in a moment).

    Ranks report an epoch (loss, validation) just after its last step, so a snapshot taken at an epoch
    boundary would otherwise lack that epoch: the resumed ranks start after it and never report it again.
    ``probe``: the server's version and clocks, cheap to take, checked first where taking the state itself
    costs (shards writing their parts): a snapshot that would be thrown away is then never taken.
    """
    reports = progress.reports()  # first: every report in it was sent before the state below was taken
    offset = int((meta.get("stream") or {}).get("offset", 0))

    def check(state: dict) -> None:
        missing = epochs_left_unreported(state, reports, consistency, progress.world_size, steps_per_epoch, epochs,
                                         offset)
        if missing:
            rank, epoch = missing[0]
            raise SnapshotNotReady(f"the PS is at step {state['version']} but rank {rank} has not reported epoch "
                                   f"{epoch} yet")

    if probe is not None:
        check(probe)
    state = server.state_dict()
    check(state)
    return {"step": int(state["version"]), "ps": state, **reports, **meta}
