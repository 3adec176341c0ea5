"""Parameter-server wire speed against its ceilings, and async throughput against ``ps.shards``.

    .venv/bin/python bench/ps_bench.py [--sizes-mb 1 4 16] [--steps 30] [--window-s 3] [--no-async]

Part 1, per parameter size (fp32), 2 workers, each in its own process:
(a) shardline PS ``sync`` round: push the gradient, pull the next version (server in this process); the
workers are on the server's host, so their payloads go through shared-memory rings (``ps.shared_memory_mb``);
(f) the same round over plain TCP (``ps.shared_memory_mb: 0``: what workers on other hosts get);
(b) ``torch.distributed`` gloo allreduce of the same bytes between 2 processes (tcp://127.0.0.1);
(c) raw loopback TCP round trip of the same bytes (send n, get n back) between 2 processes;
(d) the same PS round as (a) with ``ps.tls: true`` (TLS with the per-job certificate, fingerprint pinned);
(e) a bare socket server (threads in this process, like the PS) that moves the same bytes to the same two
client processes: receive both pushes, then send both replies; no reduction, no optimizer, no framing.
Prints ms per step and the ratios a/b, a/c, a/e, f/b, f/e and d/a (the cost of the encrypted wire), then where the
PS server's CPU goes per step (this process's CPU time over the timed steps; reduce and optimizer from the
server's own timing; the rest is the wire: syscalls, copies in the kernel, Python per frame).

Part 2: aggregate updates/s in ``async`` mode, a 64 KB model, 8/16/32 simulated workers (threads in
2 worker processes) against 1/2/4 shards in this process (``--processes``: also 1/2/4 shard processes,
``ps.server_processes``); counted as versions applied (every shard applies each push once) over a fixed
window after a warm-up, with the server's CPU ms per update (its processes' CPU time over the window:
it must not grow with the shard count; the speed-up itself needs a core per shard).

Targets (reported, not enforced): a/b <= 1.25 at 4 MB; updates/s at 2 shards >= 1.8x one shard with
32 workers.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HOST = "127.0.0.1"
MB = 1 << 20


def _free_port() -> int:
    with socket.create_server((HOST, 0)) as s:
        return s.getsockname()[1]


# -- (a) PS sync round ------------------------------------------------------------------------------
def _ps_worker(port: int, rank: int, secret: bytes, steps: int, warmup: int, out: mp.Queue, pinned=None) -> None:
    import torch

    from pipeline.ps import PSClient

    torch.set_num_threads(1)
    with PSClient(HOST, port, rank=rank, secret=secret, timeout_s=120, tls=pinned) as client:
        info = client.connect()
        grad = torch.full((info.num_params,), 1e-6)
        version, _ = client.pull(0)
        times = []
        for step in range(version, version + warmup + steps):
            started = time.perf_counter()
            client.push_pull(step, grad)  # push + pull(step + 1) in one round trip
            times.append(time.perf_counter() - started)
        client.finish()
    out.put(times[warmup:])


def ps_sync_round(nbytes: int, steps: int, warmup: int, shards: int = 1, tls: bool = False,
                  profile: dict | None = None, shared_memory: bool = True) -> float:
    import torch

    from pipeline.ps import OptimizerSpec, ParameterServer, PSSettings, new_secret
    from pipeline.wire.deadline import STEP_KEY, Timeout
    from pipeline.wire.tls import job_cert

    secret = new_secret()
    cert = job_cert(tls)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    settings = PSSettings(optimizer=OptimizerSpec(name="sgd", lr=0.01), shards=shards,
                          step_timeout=Timeout.of(120, STEP_KEY),
                          **({} if shared_memory else {"shared_memory_bytes": 0}))
    with ParameterServer(torch.zeros(nbytes // 4), settings, world_size=2, secret=secret, host=HOST,
                         tls=cert) as server:
        pinned = cert.pinned() if cert is not None else None
        procs = [ctx.Process(target=_ps_worker, args=(server.address[1], r, secret, steps, warmup, out, pinned))
                 for r in range(2)]
        for p in procs:
            p.start()
        cpu0 = stats0 = None
        while cpu0 is None:  # the timed steps start once the warm-up steps are applied
            if server.version >= warmup + 1:
                cpu0, stats0 = time.process_time(), server.stats
            time.sleep(0.0005)
        times = [out.get(timeout=300) for _ in procs]
        cpu1, stats1 = time.process_time(), server.stats
        for p in procs:
            p.join(60)
    if profile is not None:
        updates = max(stats1["timed_updates"] - stats0["timed_updates"], 1)
        profile.update(cpu_ms=1e3 * (cpu1 - cpu0) / updates,
                       reduce_ms=1e3 * (stats1["time_reduce_s"] - stats0["time_reduce_s"]) / updates,
                       optimizer_ms=1e3 * (stats1["time_optimizer_s"] - stats0["time_optimizer_s"]) / updates)
    return statistics.median(max(a, b) for a, b in zip(*times))


# -- (e) bare socket server -------------------------------------------------------------------------
def _bare_client(port: int, nbytes: int, rounds: int, out: mp.Queue) -> None:
    from pipeline.wire.sockets import set_socket_options

    sock = socket.create_connection((HOST, port))
    set_socket_options(sock)  # the PS client's options: same buffers, no Nagle
    data = memoryview(bytearray(nbytes))
    back = memoryview(bytearray(nbytes))
    times = []
    with sock:
        for _ in range(rounds):
            started = time.perf_counter()
            sock.sendall(data)
            got = 0
            while got < nbytes:
                got += sock.recv_into(back[got:])
            times.append(time.perf_counter() - started)
    out.put(times)


def bare_server_round(nbytes: int, steps: int, warmup: int) -> float:
    """(e): what a server that only moves the bytes costs: one thread per client, both pushes received
    into preallocated buffers, then both replies sent (a barrier between, as a sync round has)."""
    from pipeline.wire.sockets import listen, set_socket_options

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rounds = steps + warmup
    listener = listen(HOST, 0, backlog=8)
    port = listener.getsockname()[1]
    procs = [ctx.Process(target=_bare_client, args=(port, nbytes, rounds, out)) for _ in range(2)]
    for p in procs:
        p.start()
    barrier = threading.Barrier(2)
    reply = memoryview(bytearray(nbytes))

    def serve(sock: socket.socket) -> None:
        set_socket_options(sock)
        buf = memoryview(bytearray(nbytes))
        with sock:
            for _ in range(rounds):
                got = 0
                while got < nbytes:
                    got += sock.recv_into(buf[got:])
                barrier.wait()
                sock.sendall(reply)

    with listener:
        threads = [threading.Thread(target=serve, args=(listener.accept()[0],)) for _ in procs]
    for t in threads:
        t.start()
    times = [out.get(timeout=300) for _ in procs]
    for t in threads:
        t.join(60)
    for p in procs:
        p.join(60)
    return statistics.median(max(a, b) for a, b in zip(times[0][warmup:], times[1][warmup:]))


# -- (b) gloo allreduce -----------------------------------------------------------------------------
def _gloo_worker(rank: int, port: int, nbytes: int, steps: int, warmup: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=2)
    t = torch.full((nbytes // 4,), 1e-6)
    times = []
    for _ in range(warmup + steps):
        started = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - started)
    dist.destroy_process_group()
    out.put(times[warmup:])


def gloo_allreduce(nbytes: int, steps: int, warmup: int) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, nbytes, steps, warmup, out)) for r in range(2)]
    for p in procs:
        p.start()
    times = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    return statistics.median(max(a, b) for a, b in zip(*times))


# -- (c) raw loopback TCP -----------------------------------------------------------------------------
def _echo(port_q: mp.Queue, nbytes: int, rounds: int) -> None:
    with socket.create_server((HOST, 0)) as listener:
        port_q.put(listener.getsockname()[1])
        sock, _ = listener.accept()
    buf = memoryview(bytearray(nbytes))
    with sock:
        for _ in range(rounds):
            got = 0
            while got < nbytes:
                got += sock.recv_into(buf[got:])
            sock.sendall(buf)


def tcp_round_trip(nbytes: int, steps: int, warmup: int) -> float:
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    proc = ctx.Process(target=_echo, args=(port_q, nbytes, steps + warmup))
    proc.start()
    sock = socket.create_connection((HOST, port_q.get(timeout=60)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = memoryview(bytearray(os.urandom(1024)) * (nbytes // 1024))
    back = memoryview(bytearray(nbytes))
    times = []
    with sock:
        for _ in range(steps + warmup):
            started = time.perf_counter()
            sock.sendall(data)
            got = 0
            while got < nbytes:
                got += sock.recv_into(back[got:])
            times.append(time.perf_counter() - started)
    proc.join(60)
    return statistics.median(times[warmup:])


# -- part 2: async updates/s ----------------------------------------------------------------------------
def _async_workers(port: int, ranks: list[int], secret: bytes, stop, out: mp.Queue) -> None:
    import torch

    from pipeline.ps import PSClient

    torch.set_num_threads(1)
    errors: list[str] = []

    def loop(rank: int) -> None:
        try:
            with PSClient(HOST, port, rank=rank, secret=secret, timeout_s=120) as client:
                info = client.connect()
                grad = torch.full((info.num_params,), 1e-6)
                client.pull(0)
                step = info.clock
                while not stop.is_set():
                    client.push(step, grad)
                    client.pull(0)
                    step += 1
                client.finish()
        except Exception as exc:  # reported by the parent
            errors.append(f"rank {rank}: {exc}")

    threads = [threading.Thread(target=loop, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(errors)


def async_updates_per_s(workers: int, shards: int, nbytes: int, window_s: float, warmup_s: float = 1.5,
                        processes: bool = False, cpu: dict | None = None) -> float:
    import torch

    from pipeline.ps import OptimizerSpec, ParameterServer, PSSettings, new_secret
    from pipeline.ps.modes.consistency import Consistency
    from pipeline.wire.deadline import STEP_KEY, Timeout

    secret = new_secret()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    stop = ctx.Event()
    startup_s = 120.0  # deadline for spawning 2 processes that import torch and connecting every worker
    settings = PSSettings(optimizer=OptimizerSpec(name="sgd", lr=0.01), consistency=Consistency("async"),
                          shards=shards, step_timeout=Timeout.of(120, STEP_KEY), server_processes=processes)
    with ParameterServer(torch.zeros(nbytes // 4), settings, world_size=workers, secret=secret,
                         host=HOST) as server:
        connect_by = time.time() + startup_s
        procs = [ctx.Process(target=_async_workers, args=(server.address[1], list(range(i, workers, 2)), secret,
                                                           stop, out)) for i in range(2)]
        for p in procs:
            p.start()
        while len(server.registered_ranks) < workers:
            if time.time() > connect_by or server.aborted:
                stop.set()
                raise RuntimeError(f"only {len(server.registered_ranks)} of {workers} workers connected "
                                   f"within {startup_s:g}s")
            time.sleep(0.05)
        time.sleep(warmup_s)
        v0, t0, c0 = server.version, time.perf_counter(), server.server_cpu_seconds()
        time.sleep(window_s)
        v1, t1, c1 = server.version, time.perf_counter(), server.server_cpu_seconds()
        stop.set()
        errors = [e for _ in procs for e in out.get(timeout=300)]
        for p in procs:
            p.join(60)
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    if cpu is not None:  # the server's CPU seconds per applied update (threads: this whole process's)
        cpu["per_update_ms"] = 1e3 * (c1 - c0) / max(v1 - v0, 1)
    return (v1 - v0) / (t1 - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--model-kb", type=int, default=64)
    parser.add_argument("--no-async", action="store_true", help="part 1 only")
    parser.add_argument("--no-tls", action="store_true", help="skip (d), the PS round over TLS")
    parser.add_argument("--processes", action="store_true",
                        help="part 2 also with ps.server_processes (each shard in its own process)")
    parser.add_argument("--no-sync", action="store_true", help="part 2 only")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    print(f"host: {os.cpu_count()} cpus, torch {torch.__version__}, python {sys.version.split()[0]}")
    print("\nsync round, 2 worker processes (median ms per step)")
    print(f"{'size':>6} | {'(a) PS push+pull':>16} | {'(b) gloo allreduce':>18} | {'(c) TCP round trip':>18} | "
          f"{'(d) PS over TLS':>15} | {'(e) bare server':>15} | {'(f) PS over TCP':>15} | {'a/b':>5} | {'a/c':>5} | "
          f"{'a/e':>5} | {'f/b':>5} | {'f/e':>5} | {'d/a':>5}")
    profiles = {}
    for mb in [] if args.no_sync else args.sizes_mb:
        nbytes = int(mb * MB)
        profiles[mb] = {}
        a = ps_sync_round(nbytes, args.steps, args.warmup, profile=profiles[mb])
        b = gloo_allreduce(nbytes, args.steps, args.warmup)
        c = tcp_round_trip(nbytes, args.steps, args.warmup)
        d = float("nan") if args.no_tls else ps_sync_round(nbytes, args.steps, args.warmup, tls=True)
        e = bare_server_round(nbytes, args.steps, args.warmup)
        f = ps_sync_round(nbytes, args.steps, args.warmup, shared_memory=False)
        print(f"{mb:>4g}MB | {a * 1e3:>16.2f} | {b * 1e3:>18.2f} | {c * 1e3:>18.2f} | {d * 1e3:>15.2f} | "
              f"{e * 1e3:>15.2f} | {f * 1e3:>15.2f} | {a / b:>5.2f} | {a / c:>5.2f} | {a / e:>5.2f} | "
              f"{f / b:>5.2f} | {f / e:>5.2f} | {d / a:>5.2f}", flush=True)
    if profiles:
        print("\nPS server CPU per sync step (ms; 2 pushes reduced, 1 optimizer step, 2 PARAMS sent)")
        print(f"{'size':>6} | {'CPU total':>9} | {'reduce':>6} | {'optimizer':>9} | {'wire + rest':>11}")
    for mb, prof in profiles.items():
        rest = prof["cpu_ms"] - prof["reduce_ms"] - prof["optimizer_ms"]
        print(f"{mb:>4g}MB | {prof['cpu_ms']:>9.2f} | {prof['reduce_ms']:>6.2f} | {prof['optimizer_ms']:>9.2f} | "
              f"{rest:>11.2f}")
    if args.no_async:
        print(f"\ntotal {time.perf_counter() - started:.0f}s")
        return
    print(f"\nasync updates/s, {args.model_kb} KB model, workers as threads in 2 processes; shards as threads "
          f"of this process, or (ps.server_processes) one child process each; server CPU ms per update")
    head = " | ".join(f"{f'{k} shard(s)':>11} | {'cpu ms/upd':>10}" for k in args.shards)
    print(f"{'workers':>7} | {'shards as':>9} | {head} | 2 vs 1")
    for w in args.workers:
        for processes in ([False, True] if args.processes else [False]):
            rates, cpus = {}, {}
            for k in args.shards:
                cpus[k] = {}
                rates[k] = async_updates_per_s(w, k, args.model_kb * 1024, args.window_s, processes=processes,
                                               cpu=cpus[k])
            ratio = f"{rates[2] / rates[1]:.2f}x" if 1 in rates and 2 in rates else "-"
            cells = " | ".join(f"{rates[k]:>11.0f} | {cpus[k]['per_update_ms']:>10.3f}" for k in args.shards)
            print(f"{w:>7} | {'processes' if processes else 'threads':>9} | {cells} | {ratio}", flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
