"""Driver side: where the parameter server lives during the attempts of one run (``ps.placement``).

``DriverPS``: in this process; it outlives a failed attempt, so a retry continues from its state.
``TaskPS``: in rank 0's barrier task; it dies with a failed attempt, so a retry restarts it from this
run's newest checkpoint. ``HostsPS``: one shard per worker host, this process the coordinator; the state
lives here between attempts. All run their attempts through ``attempts.run_attempts``.
"""
from __future__ import annotations

from pipeline.launch.placement.run import Outcome, TrainingRun

__all__ = ["Outcome", "TrainingRun", "placement_for"]


def placement_for(run: TrainingRun):
    from pipeline.launch.placement.driver_hosted import DriverPS
    from pipeline.launch.placement.hosts_spread import HostsPS
    from pipeline.launch.placement.task_hosted import TaskPS

    return {"task": TaskPS, "hosts": HostsPS}.get(run.cfg.ps.placement, DriverPS)(run)
