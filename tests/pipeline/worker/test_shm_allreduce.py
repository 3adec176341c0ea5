"""The shared-memory allreduce (pipeline.worker.shm_allreduce) in real two-process gloo groups: DDP with
it trains as DDP over gloo (within 1e-6), buckets larger than a slot go in pieces, ranks on different
hosts keep gloo, a dead peer fails the wait at once naming it, and no segment is left in /dev/shm."""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import traceback

import pytest

from pipeline.wire import shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory rings need x86-64 Linux")


def _group(rank: int, store_path: str):
    import datetime

    import torch.distributed as dist

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))


def _train(rank: int, store_path: str, use_shm: bool, piece_bytes: int, out) -> None:
    try:
        import torch
        import torch.distributed as dist

        from pipeline.worker import shm_allreduce
        from pipeline.worker.ddp import wrap

        torch.set_num_threads(1)
        shm_allreduce.PIECE_BYTES = piece_bytes
        _group(rank, store_path)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.ReLU(), torch.nn.Linear(300, 5))
        ddp = wrap(model, "cpu", shared_memory=use_shm)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        for _ in range(5):
            for p in model.parameters():
                p.grad = None
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 5, (16,), generator=g)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out.put((rank, getattr(ddp, "_shardline_shm_hook", None) is not None, flat.numpy().tobytes()))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def _run(target, args_of, timeout=30):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(r), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(20)
    return results


def _segments() -> set:
    return set(glob.glob(os.path.join(shm.SHM_DIR, "shardline-*")))


@pytest.mark.parametrize("piece_bytes", [16 << 20, 4096])  # one round per bucket; many rounds per bucket
def test_ddp_through_shared_memory_trains_as_ddp_over_gloo(tmp_path, piece_bytes) -> None:
    import numpy as np

    before = _segments()
    runs = {}
    for use_shm in (False, True):
        path = str(tmp_path / f"store-{use_shm}")
        results = _run(_train, lambda r: (r, path, use_shm, piece_bytes))
        assert all(res[1] != "error" for res in results), results
        assert [res[1] for res in results] == [use_shm, use_shm]
        runs[use_shm] = [np.frombuffer(res[2], dtype=np.float32) for res in results]
    assert np.array_equal(runs[True][0], runs[True][1])  # the replicas agree exactly
    assert np.allclose(runs[True][0], runs[False][0], atol=1e-6)
    assert _segments() == before


def _identity_then_hook(rank: int, store_path: str, host: str, out) -> None:
    try:
        from pipeline.wire.deadline import STEP_KEY, Timeout
        from pipeline.worker import shm_allreduce

        shm_allreduce._host_identity = lambda: host
        _group(rank, store_path)
        hook = shm_allreduce.join(rank, 2, Timeout.of(30, STEP_KEY))
        out.put((rank, hook is not None, ""))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def test_ranks_on_different_hosts_keep_gloo(tmp_path) -> None:
    results = _run(_identity_then_hook, lambda r: (r, str(tmp_path / "store"), f"host-{r}"))
    assert [res[1] for res in results] == [False, False], results


def _die_or_wait(rank: int, store_path: str, out) -> None:
    try:
        import torch

        from pipeline.wire.deadline import STEP_KEY, Timeout
        from pipeline.worker import shm_allreduce

        _group(rank, store_path)
        hook = shm_allreduce.join(rank, 2, Timeout.of(30, STEP_KEY))
        if rank == 1:
            out.put((rank, "left", ""))
            out.close()
            out.join_thread()
            os._exit(0)  # gone before its first bucket (a zombie until the test joins it: dead all the same)
        try:
            hook.allreduce_(torch.ones(1000))
            out.put((rank, "no error", ""))
        except RuntimeError as exc:
            out.put((rank, "raised", str(exc)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def test_a_dead_peer_fails_the_wait_naming_it(tmp_path) -> None:
    results = _run(_die_or_wait, lambda r: (r, str(tmp_path / "store")))
    assert results[0][1] == "raised", results
    assert "rank 1" in results[0][2] and "died during the shared-memory allreduce" in results[0][2]
