"""bench/validation_bench.py's old placement, rebuilt from the plans train() makes."""
import dataclasses

from pipeline.models import ModelSpec
from pipeline.worker import WorkerPlan
from pipeline.worker.validation import part_rows


def _plans(world: int, rows: int) -> list[WorkerPlan]:
    spec = ModelSpec(kind="mlp", num_features=4, num_outputs=2, task="classification")
    base = WorkerPlan(rank=0, world_size=world, generation=1, train_files=("t.parquet",), validation_files=(),
                      model=spec, features_field="features", label_field="label", epochs=1, steps_per_epoch=1, seed=0)
    return [dataclasses.replace(base, rank=r, validation_files=("v0.parquet", "v1.parquet"),
                                validation_rows=part_rows(rows, r, world)) for r in range(world)]


def test_rank0_alone_gives_rank_0_every_row_and_the_others_none(load_bench):
    bench = load_bench("validation_bench")
    plans = _plans(3, 100)
    old = bench.rank0_alone(plans)
    assert [(p.rank, p.validation_files, p.validation_rows) for p in old] == [
        (0, ("v0.parquet", "v1.parquet"), None), (1, (), None), (2, (), None)]
    assert [dataclasses.replace(p, validation_files=(), validation_rows=None) for p in old] == \
        [dataclasses.replace(p, validation_files=(), validation_rows=None) for p in plans]  # nothing else moved
    # a split with fewer rows than ranks: rank 0 may have had no part of its own, it still gets the files
    few = [dataclasses.replace(p, validation_files=p.validation_files if p.rank == 2 else (),
                               validation_rows=(0, 1) if p.rank == 2 else None) for p in plans]
    assert bench.rank0_alone(few)[0].validation_files == ("v0.parquet", "v1.parquet")
