"""Driver side, ``ps.placement: hosts``: the parameter server's shards on the workers' hosts, this process
the coordinator.

Everything but where the shards run is the driver placement's (``DriverPS``): the checkpointer, the stage
watchdog, the stall watch, the progress bar, the monitor and the retry decisions all talk to a
``SpreadServer``, which keeps the run's state between attempts. Per attempt this module adds:

* a ``ShardRegistry`` on the driver's address, which the first task of each host points its shard
  process at (``task.host_shard``);
* ``ShardAdopter``, a guard of the barrier job: it waits for every host's process, attaches them (the
  state goes out once, as slices), and once every rank has finished or failed (or the attempt was
  aborted) takes the state back and ends the shards, which is what lets the host's first tasks return.

A host lost with its shard leaves no consistent state: the retry starts every shard from the newest
checkpoint (``StateAfterFailure.CHECKPOINT`` through the one ``RetryPolicy``), spread over the hosts that
attempt lands on.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

from pipeline.errors import WorkerTrainingFailedError
from pipeline.launch.placement.driver_hosted import DriverPS
from pipeline.launch.plans import deadlines, worker_plans

log = logging.getLogger(__name__)

# Polls of the attached shards' roster (a control round trip per shard): a few a second keeps the end of
# an attempt prompt and the driver's link quiet.
ADOPTER_POLL_S = 0.2
# The largest control message: a slice's parameters, optimizer state (Adam: two more) and the buffers.
STATE_WORDS_PER_PARAM = 4
CONTROL_SLACK_BYTES = 64 << 20
# The shards' writes of a checkpoint set's parts: at least this long (a slice to an object store).
PART_WRITE_S = 60.0


class ShardAdopter:
    """The attempt's guard that attaches the hosts' shard processes and ends them (see module docstring)."""

    def __init__(self, server, registry, world_size: int, generation: int, connect) -> None:
        self._server = server
        self._registry = registry
        self._world_size = world_size
        self._generation = generation
        self._connect = connect
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ps-shard-adopter")
        self.error: Optional[str] = None

    def __enter__(self) -> "ShardAdopter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._server.abandon(self._generation)  # an attach still under way closes instead of committing
        self._registry.close()  # a wait for hosts that never came ends now
        self._thread.join(30)
        if self._server.attached:  # the job ended before every rank did (Spark stopped it)
            self._server.detach()

    def _run(self) -> None:
        try:
            children = self._registry.wait_for_hosts(self._connect)
        except Exception as exc:  # noqa: BLE001 - the attempt's cause, for the driver's failure account
            if not self._stop.is_set():
                self._give_up(f"the parameter-server shards did not all reach the driver: {exc}")
            return
        try:
            self._server.attach(children, self._generation)
        except Exception as exc:  # noqa: BLE001
            for child in children:
                child.close()  # their processes end, and their tasks report it through the allGather
            self._give_up(f"the driver could not set up the parameter-server shards on {len(children)} host(s): "
                          f"{type(exc).__name__}: {exc}")
            return
        everyone = set(range(self._world_size))
        while not self._stop.wait(ADOPTER_POLL_S):
            server = self._server
            try:
                if server.aborted or (server.finished_ranks | set(server.failures)) >= everyone:
                    break
            except Exception:  # noqa: BLE001 - the views do not raise today; if one ever does, this thread
                # must still detach below, or the hosts' first tasks would wait for their shards forever
                log.warning("polling the spread shards failed; ending them", exc_info=True)
                break
        self._server.detach()

    def _give_up(self, text: str) -> None:
        self.error = text
        log.error("%s", text)


class HostsPS(DriverPS):
    """``DriverPS`` whose server is a ``SpreadServer`` attached per attempt to the hosts' shard processes."""

    def _build_server(self, settings):
        from pipeline.launch.placement.ps_address import local_master
        from pipeline.launch.sparse_tables import sparse_spec
        from pipeline.ps.server.spread import SpreadServer
        from pipeline.storage import is_remote

        run, cfg = self.run, self.run.cfg
        self.sparse_spec = sparse_spec(cfg, run.spec)  # ps.sparse: each host's shard keeps its part of the rows
        # Checkpoints as sets of parts the shards write themselves, wherever every host reaches the store.
        self.shards_write = is_remote(run.store.directory) or cfg.workdir_on_every_host or local_master(run.spark)
        log.info("checkpoints: %s", "each shard writes its part to %s" % run.store.parts_directory
                 if self.shards_write else "taken by the driver from the shards (train.checkpoint_dir is a local "
                 "path the hosts do not share)")
        log.info("ps.placement=hosts: one parameter-server shard per worker host, this process coordinating")
        return SpreadServer(run.initial, settings, world_size=cfg.parallelism.tasks, secret=self._secret,
                            on_metrics=run.progress, buffers=run.buffer_store(), tls=self._tls,
                            sparse=self.sparse_spec)

    def _snapshot(self) -> dict:
        """A checkpoint whose PS state is a set of parts the shards wrote (``SpreadServer.write_parts``)."""
        if not self.shards_write:
            return super()._snapshot()
        import uuid

        from pipeline.errors import PSError
        from pipeline.launch.ps_side.snapshot import take_snapshot

        meta, store, server, progress = self.run.checkpoint_meta, self.run.store, self.server, self.run.progress
        # Near an epoch's end the PS runs ahead of the epoch reports: the version and clocks are asked first,
        # so a snapshot that would be thrown away never writes the whole model to the store.
        probe = {"version": server.version, "clocks": dict(server.stats.get("clock_by_rank") or {})}
        timeout = max(PART_WRITE_S, deadlines(self.run.cfg).step.seconds)
        token = uuid.uuid4().hex[:12]
        parts = _PartsWriter(lambda: server.write_parts(store.parts_directory, token, timeout))
        try:
            return take_snapshot(parts, progress, server.consistency, meta.steps_per_epoch, meta.epochs,
                                 probe=probe, **meta.record())
        except BaseException as exc:
            if parts.asked:  # never committed: no checkpoint names them
                store.discard_parts(f"{token}-")
            if isinstance(exc, PSError) and server.attached and not server.aborted and \
                    "consistent snapshot" not in str(exc):
                # A shard could not write (no credentials for the store, no permission): the driver takes
                # this and every later checkpoint itself, as where the hosts share no store.
                log.warning("the shards could not write their checkpoint parts to %s (%s); the driver takes the "
                            "checkpoints from now on", store.parts_directory, exc)
                self.shards_write = False
                return super()._snapshot()
            raise

    @property
    def keeps_sparse_tables(self) -> bool:
        return self.sparse_spec is not None

    def run_attempt(self, attempt: int) -> list[dict]:
        from pipeline.launch.task.body import TaskWiring
        from pipeline.launch.task.host_shard import HostShardWiring
        from pipeline.ps.processes.registry import ShardRegistry

        run, cfg, server = self.run, self.run.cfg, self.server
        generation = server.generation
        plans = worker_plans(cfg, run.manifest, run.spec, run.steps_per_epoch, generation, attempt, None,
                             stream=run.stream)
        words = run.initial.numel() * STATE_WORDS_PER_PARAM + run.initial_buffers.numel()
        max_bytes = 4 * words + CONTROL_SLACK_BYTES + (self.sparse_spec.max_state_bytes() if self.sparse_spec else 0)
        connect = deadlines(cfg).connect
        with ShardRegistry(self._host, self._secret, generation, max_bytes=max_bytes, tls=self._tls) as registry:
            wiring = TaskWiring(self._secret, cfg.train.log_tail_lines, tls=self._tls,
                                hosts=HostShardWiring(registry.address, connect, max_bytes))
            adopter = ShardAdopter(server, registry, cfg.parallelism.tasks, generation, connect)
            try:
                rows = self._run_job(attempt, plans, wiring, guards=(adopter,))
                if rows and server.lost:  # every rank finished, but a shard died before its state came back
                    cause = server.failure_cause or "a parameter-server shard was lost before the driver took the state"
                    raise WorkerTrainingFailedError({}, attempt, cause=cause, server_error=cause)
                return rows
            except WorkerTrainingFailedError as failure:
                if adopter.error and not failure.server_error:
                    raise WorkerTrainingFailedError(failure.failures, attempt, failure.cause, failure.stopped,
                                                    server_error=adopter.error) from failure
                raise

    def outcome(self, rows: list[dict]):
        outcome = super().outcome(rows)
        server = self.server
        log.info("parameter-server shards were on %s", ", ".join(server.hosts) or "no host")
        by_shard = server.stats.get("by_shard") or [server.stats]
        if self.sparse_spec is not None and len(by_shard) == len(server.hosts):
            rows = [sum(t["rows"] for t in s.get("sparse", {}).get("tables", {}).values()) for s in by_shard]
            log.info("sparse table rows per shard: %s", ", ".join(f"{h} {n}" for h, n in zip(server.hosts, rows)))
        return outcome


class _PartsWriter:
    """The server as ``take_snapshot`` sees it, whose state is the record of the parts its shards wrote."""

    def __init__(self, write) -> None:
        self._write = write
        self.asked = False  # whether the shards were told to write (a probe that was not ready tells none)

    def state_dict(self) -> dict:
        self.asked = True
        return self._write()
