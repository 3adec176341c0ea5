"""Time per training step of each strategy, predicted term by term from measured figures.

Pure arithmetic: the figures come from the launch probes (``probes.py``) or, for ``shardline plan``, from
what the user assumes. A step here is one batch on every rank (what the ranks' own clock measures), so the
strategies compare on samples/s. The byte counts are the per-link formulas of docs/training.md ("Bytes a
synchronous dense step moves"), which bench/network_bench.py measured to within 0.3 %; docs/training.md
("Choosing the strategy") walks through every term.

Why hand-written: no library models a parameter server against a ring allreduce on measured links; the
terms are few and each is a measured rate times a byte count.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pipeline.launch.strategy.candidates import Candidate


@dataclass(frozen=True)
class Probes:
    """The figures a prediction starts from. Rates are bytes per second, each direction."""

    ranks: int                  # N, training ranks
    hosts: int                  # H, hosts the ranks are on
    ranks_per_host: int         # R, ranks on the busiest host
    param_bytes: int            # M, the dense fp32 parameters
    compute_s: float            # forward + backward of one batch, the slowest rank, every rank computing at once
    optimizer_s: float          # one local optimizer step over M (allreduce and average step locally)
    link_Bps: float             # one host's link to another host
    driver_Bps: float           # what the driver's link takes with every host sending at once
    copy_Bps: float             # one memory copy on a host (shared-memory rings, the one-host allreduce)
    server_Bps: float           # a server's sum and optimizer step, per byte of one rank's push
    topk_s_per_byte: float = 0.0  # selecting the top-k entries of a gradient, per byte of it
    cast_s_per_byte: float = 0.0  # fp32 -> fp16/bf16, per byte
    data_s: float = 0.0         # reading and decoding one batch's rows (the loader's reader, in the task)
    buffer_bytes: int = 0       # buffers pulled with the parameters (BatchNorm statistics)
    sparse_bytes: float = 0.0   # ps.sparse: the rows of one rank's step, each way (pulled, then pushed)
    sparse_rows: float = 0.0    # ps.sparse: distinct rows of one rank's step, over every table
    sparse_server_s: float = 0.0  # ps.sparse: a server's lookup and row-optimizer step of one rank's rows
    burst_bytes: float = 0.0    # what a host's link passes at once after an idle spell (a token-bucket shaper's burst)
    same_host: bool = False     # every rank on the server's own host: payloads through shared memory
    shared_cpu: bool = False    # the driver runs on the ranks' CPUs (one machine; a testbed's namespaces)
    cpu_share: float = 1.0      # ranks per core where ranks share a machine's cores (>= 1): CPU-bound fixed costs stretch
    source: str = "probed"      # probed | cached | assumed

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Constants:
    """Fixed costs per step that no rate explains (wake-ups, request handling, the barrier of a round), in
    seconds; where each comes from is docs/training.md "Choosing the strategy" (bench/strategy_bench.py fits)."""

    loop_s: float = 0.00045         # a training step's own bookkeeping (loader hand-off, timers, loss readout)
    sparse_row_s: float = 6e-6      # a worker's share per distinct row: ids made unique, rows gathered, grads merged
    ps_round_s: float = 0.00075     # a sync PS round on the driver: two requests, the last push's wake-up
    hosts_round_s: float = 0.0012   # the same round on H host shards (H requests each way per rank)
    async_round_s: float = 0.00085  # an async push + pull: no wait for other ranks
    allreduce_round_s: float = 0.0002  # DDP's bucket hooks and one shared-memory allreduce (one host)
    ring_step_s: float = 0.0006     # one of the 2(N-1) steps of gloo's TCP ring (ranks on several hosts)
    average_round_s: float = 0.0006  # one parameter average (average mode), as a PS round
    # ps.placement=hosts with H > 2 stretches the link time by 1 + this. The bytes are the formula's
    # (network_bench), but a rank's pushes to H-1 shards and their answers do not overlap as the formula
    # assumes: strategy_bench measured 1.4-1.6x the link time at H=3, 1.0x at H=2. Only H=3 was measured, so
    # larger H gets the same stretch, not an extrapolation.
    hosts_fanout_stretch: float = 0.5
    # Ties: a strategy with fewer freedoms (allreduce, then the driver's PS, first) is kept unless another is
    # predicted faster by more than this fraction: no exactness or simplicity is given up for noise.
    prefer_within: float = 0.05


CONSTANTS = Constants()
COMPRESSED = {"none": 1.0, "fp16": 0.5, "bf16": 0.5}


@dataclass
class Prediction:
    candidate: Candidate
    terms: dict[str, float] = field(default_factory=dict)  # seconds per step, in the order they add up

    @property
    def step_s(self) -> float:
        return sum(self.terms.values())

    @property
    def biggest(self) -> str:
        return max(self.terms, key=self.terms.get)


def _push_ratio(compression: str, topk_ratio: float) -> float:
    # top-k sends an int32 index and an fp32 value per kept entry: 2k of the fp32 bytes
    return 2 * topk_ratio if compression == "topk" else COMPRESSED[compression]


def predict(candidate: Candidate, p: Probes, *, topk_ratio: float = 0.01, sync_every: int = 4,
            k: Constants = CONSTANTS) -> Prediction:
    """The candidate's time per step, term by term (docs/training.md "Choosing the strategy")."""
    if candidate.backend == "allreduce":
        return _allreduce(candidate, p, k)
    return _ps(candidate, p, topk_ratio, sync_every, k)


def _allreduce(candidate: Candidate, p: Probes, k: Constants) -> Prediction:
    m, n = p.param_bytes, p.ranks
    terms = {**_local(p, k), "optimizer": p.optimizer_s}
    if p.hosts == 1:  # every rank's buckets through /dev/shm: each written once, all N read and summed
        terms["exchange"] = (n + 1) * m / p.copy_Bps
    else:  # ring: 2M(N-1)/N each way on every host link, both directions at once
        ring = 2 * m * (n - 1) / n
        terms["exchange"] = ring / p.link_Bps
        terms["burst"] = -min(ring, p.burst_bytes) / p.link_Bps
    ring_round = k.allreduce_round_s if p.hosts == 1 else 2 * (n - 1) * k.ring_step_s
    terms["round"] = ring_round * p.cpu_share
    return Prediction(candidate, terms)


def _local(p: Probes, k: Constants) -> dict[str, float]:
    """What every strategy's step spends on its rank before it communicates."""
    # the probe's compute is its least crowded spell: ranks beyond a machine's cores share them in training
    return {"compute": p.compute_s * p.cpu_share, "data": p.data_s, "loop": k.loop_s * p.cpu_share}


def _links(candidate: Candidate, p: Probes, up: float, down: float, burst: float = 0.0,
           k: Constants = CONSTANTS) -> tuple[float, float]:
    """Seconds to move one rank's push of ``up`` and pull of ``down`` bytes with every rank doing the same;
    ``burst``: the bytes each direction of a host link passes at once (the link idled since its last phase)."""
    n, h, r = p.ranks, p.hosts, p.ranks_per_host
    if p.same_host or (candidate.placement == "hosts" and h == 1):
        return up / p.copy_Bps, down / p.copy_Bps

    def host(nbytes: float) -> float:
        return max(0.0, nbytes - burst) / p.link_Bps

    if candidate.placement == "hosts":  # a host sends its ranks' foreign slices and its shard's answers
        share, stretch = (h - 1) / h, 1 + (k.hosts_fanout_stretch if h > 2 else 0.0)
        return (stretch * host(max(r * up * share, (n - r) * up / h)),
                stretch * host(max(r * down * share, (n - r) * down / h)))
    # driver: each host link carries its ranks' bytes, the driver's link every rank's
    return max(host(r * up), n * up / p.driver_Bps), max(host(r * down), n * down / p.driver_Bps)


def _ps(candidate: Candidate, p: Probes, topk_ratio: float, sync_every: int, k: Constants) -> Prediction:
    m, n = p.param_bytes, p.ranks
    shards = p.hosts if candidate.placement == "hosts" else 1
    averaging = candidate.mode == "average"
    ratio = 1.0 if averaging else _push_ratio(candidate.compression, topk_ratio)
    terms = _local(p, k)
    if averaging:
        terms["optimizer"] = p.optimizer_s
    if not averaging and candidate.compression == "topk":
        terms["compress"] = m * p.topk_s_per_byte
    elif not averaging and candidate.compression in ("fp16", "bf16"):
        terms["compress"] = m * p.cast_s_per_byte
    up, down = m * ratio, m + p.buffer_bytes
    push, pull = _links(candidate, p, up, down, k=k)
    server = n * m / shards / p.server_Bps  # every rank's slice summed, then one optimizer step
    every = sync_every if averaging else 1
    terms["push"], terms["pull"] = push / every, pull / every
    rows_up = rows_down = 0.0
    if p.sparse_bytes:
        rows_up, rows_down = _links(candidate, p, p.sparse_bytes, p.sparse_bytes, k=k)
        terms["sparse rows"] = rows_up + rows_down
        terms["sparse client"] = p.sparse_rows * k.sparse_row_s
        # every rank's rows looked up and stepped by the server(s): a host's shard holds 1/H of each rank's rows
        terms["sparse server"] = n * p.sparse_server_s / shards
    if p.burst_bytes:  # each direction's phases of a step run back to back, then the link idles (compute)
        with_burst = _links(candidate, p, up + p.sparse_bytes, down + p.sparse_bytes, p.burst_bytes, k=k)
        terms["burst"] = (sum(with_burst) - push - pull - rows_up - rows_down) / every
    round_s = {"sync": k.hosts_round_s if shards > 1 else k.ps_round_s, "average": k.average_round_s}
    if candidate.mode in ("async", "ssp"):
        # no round: each rank's push is applied alone, so the server and the driver's link only bound the
        # throughput: with N ranks a step, their work per step queues behind the others'
        # a server on the ranks' own CPUs (host shards; one machine) takes its work for every rank's push from
        # the cores they compute on: nothing of it overlaps
        busy = n if (candidate.placement == "hosts" or p.shared_cpu) else 1
        own = m / shards / p.server_Bps  # one push's apply
        own_rows = p.sparse_server_s / shards if p.sparse_bytes else 0.0
        terms["server"] = busy * own
        if p.sparse_bytes:
            terms["sparse server"] = busy * own_rows
        terms["round"] = k.async_round_s * p.cpu_share
        cycle = sum(terms.values())
        bound = max(n * (own + own_rows),
                    n * m * ratio / p.driver_Bps if candidate.placement == "driver" and not p.same_host else 0.0)
        terms["queue"] = max(0.0, bound - cycle)
    else:
        terms["server"] = server / every
        terms["round"] = round_s[candidate.mode] * p.cpu_share / every
    return Prediction(candidate, terms)
