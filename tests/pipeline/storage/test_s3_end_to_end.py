"""The whole pipeline on object storage, against a real S3-compatible server (moto's, on 127.0.0.1):
raw Parquet on s3:// -> ETL writes the shard set to s3:// -> 2 workers stream it from s3:// -> checkpoints
to s3:// -> the run fails mid-way -> --resume from the s3:// checkpoint -> evaluate -> score reading and
writing s3://; nothing lands in a local shard, checkpoint or model folder, and the secret key is never logged."""
from __future__ import annotations

import logging
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from pipeline import steps, storage
from pipeline.checkpoints import CheckpointStore
from pipeline.config import load
from pipeline.errors import WorkerTrainingFailedError
from pipeline.etl.digits import land_digits
from pipeline.score import score
from pipeline.shards import steps_per_epoch

pytestmark = pytest.mark.slow


def test_etl_train_kill_resume_evaluate_score_all_on_s3(s3_spark, s3, conf_dir, tmp_path, caplog, capfd):
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="pipeline")
    spark = s3_spark
    work = tmp_path / "work"
    raw = s3.url("e2e", "raw", "digits")
    fs, raw_path = storage.resolve(raw)
    pafs.copy_files(str(land_digits(tmp_path / "landed")), raw_path, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)
    overrides = [f"workdir={work}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "data.source=parquet",
                 f"data.path={raw}", f"data.shards_dir={s3.url('e2e', 'shards')}",
                 f"train.checkpoint_dir={s3.url('e2e', 'checkpoints')}", f"train.model_dir={s3.url('e2e', 'model')}",
                 "train.epochs=2", "train.batch_size=32", "train.checkpoint_every=10", "tracking.log_model=false",
                 "model.hidden=[32]"]
    cfg = load(f"{conf_dir}/digits.yaml", overrides)

    manifest = steps.etl(spark, cfg)
    assert manifest.root == s3.url("e2e", "shards") and steps.load_shards(cfg).fingerprint == manifest.fingerprint
    planned = steps_per_epoch(manifest, cfg.parallelism.data, cfg.train.batch_size) * cfg.train.epochs

    # The first run fails for good mid-way (rank 1 raises, no retries): what a killed attempt leaves.
    failing = load(f"{conf_dir}/digits.yaml", overrides + ["faults.fail_rank=1", f"faults.fail_step={planned // 2}",
                                                           "train.max_attempts=1"])
    with pytest.raises(WorkerTrainingFailedError):
        steps.train(spark, failing)
    store = CheckpointStore(cfg.train.checkpoint_dir)
    killed_at = store.latest().step
    assert 0 < killed_at < planned
    assert store.latest().path.startswith(f"{s3.bucket}/e2e/checkpoints/")

    outcome = steps.train(spark, cfg, resume=True)
    final = store.load(store.latest())
    assert final["step"] == planned and final["ps"]["steps_applied_by_rank"] == {0: planned, 1: planned}
    assert final["extra"]["mlflow_run_id"] == outcome.run_id
    assert "resuming from checkpoint" in caplog.text
    assert storage.exists(s3.url("e2e", "model", "model.pt"))

    evaluation = steps.evaluate(spark, cfg)
    assert evaluation.test_metrics["accuracy"] > 0.8, evaluation.test_metrics

    scored_url = s3.url("e2e", "scored")
    result = score(spark, cfg, f"runs:/{outcome.run_id}", raw, scored_url)
    written = storage.list_files(scored_url)
    assert any(p.endswith("/_SUCCESS") for p in written)
    scored = pq.read_table(storage.resolve(scored_url)[1], filesystem=fs)
    assert scored.num_rows == result.written_rows == result.input_rows == pq.read_table(raw_path, filesystem=fs).num_rows

    # Nothing written to a local shard, checkpoint or model path; the secret reached no log.
    local = [p for p in work.rglob("*") if p.is_file()] if work.exists() else []
    assert not [p for p in local if p.suffix in (".parquet", ".pt") or "split=" in str(p)], local
    out, err = capfd.readouterr()
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in caplog.text + out + err
