"""Runs beside the parameter server, wherever it is (the driver, or rank 0's task with ps.placement=task):
epoch progress, checkpoint snapshots, the stage watchdog."""
