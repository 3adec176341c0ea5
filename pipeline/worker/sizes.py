"""The sizes of the model this task builds, known before it connects to the parameter server.

The client holds every WELCOME against them before allocating anything the server announces
(``pipeline.ps.transport.protocol.check_welcome``): a listener squatting the PS address, or a server of another
model, is refused instead of making the worker allocate ``num_params × 4`` bytes it named itself.

Why the meta device: the counts come from the same spec and factory the training loop builds from, without
allocating the weights twice; a factory that cannot build on meta is built on the CPU instead.
"""
from __future__ import annotations

import logging
from typing import Optional

from pipeline.worker.plan import WorkerPlan

log = logging.getLogger(__name__)


def _module(plan: WorkerPlan):
    from pipeline.models import build_model

    model = build_model(plan.model)
    if plan.stage is not None:
        from pipeline.parallel.stages import model_stages

        model = model_stages(model, plan.stage.stages, plan.stage.cuts)[plan.stage.stage]
    return model


def expected_sizes(plan: WorkerPlan) -> tuple[Optional[int], Optional[int]]:
    """(parameters, fp32 buffer words) of this task's module (its stage's with ``parallelism.pipeline``);
    (None, None) when the model cannot be built here: then the loop's own build raises, inside the PS
    session, where the failure reaches the server and the driver as it always did."""
    import torch

    from pipeline.models.flat import num_parameters
    from pipeline.models.state import buffer_layout, layout_slots

    for device in ("meta", "cpu"):
        try:
            with torch.device(device):
                model = _module(plan)
            return num_parameters(model), layout_slots(buffer_layout(model))
        except Exception as exc:  # noqa: BLE001 - reported by the real build, inside the session
            log.debug("counting the model's parameters on %s failed: %s", device, exc)
    return None, None
