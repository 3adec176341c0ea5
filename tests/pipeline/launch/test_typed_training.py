"""Every feature type through real barrier training: the PS and allreduce, a built-in model and a factory
whose module takes the batch dict, then Spark evaluation on the test split."""
import pytest

from pipeline.config import with_changes
from pipeline.etl import run_etl
from pipeline.evaluate import evaluate
from pipeline.launch import train
from tests.pipeline.typed_data import typed_config, write_typed_source

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def typed(spark, conf_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("typed-training")
    source = write_typed_source(work / "src")
    cfg = with_changes(typed_config(conf_dir, work, source, name="typed-training"),
                       train={"epochs": 6, "optimizer": "adam", "lr": 0.01}, ps={"timeout_s": 30})
    return cfg, run_etl(spark, cfg)


@pytest.mark.parametrize("backend", ["ps", "allreduce"])
def test_tabular_model_learns_from_every_feature_type(spark, typed, backend):
    cfg, manifest = typed
    result = train(spark, with_changes(cfg, train={"backend": backend}), manifest)
    keys = set(manifest.feature_set.batch_keys())
    assert keys == {"numeric", "city", "shop", "vec", "img", "title", "title__len"}
    assert result.spec.feature_set == manifest.feature_set  # the model was built from the fitted spec
    metrics = evaluate(spark, manifest, result.spec, result.parameters, "test").metrics
    # the label is written into the image's brightness: a model that reads the image gets it right
    assert metrics["accuracy"] >= 0.9, metrics
    assert 0.9 <= metrics["roc_auc"] <= 1.0


@pytest.mark.parametrize("backend", ["ps", "allreduce"])
def test_a_factory_taking_the_dict_trains(spark, typed, user_models, backend):
    cfg, manifest = typed
    custom = with_changes(cfg, name=f"typed-factory-{backend}", model={"factory": "user_models:embeddings_and_conv",
                                                                        "factory_kwargs": {"width": 8}},
                          train={"backend": backend})
    result = train(spark, custom, manifest)
    assert [r["rank"] for r in result.ranks] == [0, 1]
    metrics = evaluate(spark, manifest, result.spec, result.parameters, "test").metrics
    assert metrics["accuracy"] >= 0.9, metrics


def test_pipeline_stages_take_the_dict_in_the_first_stage(spark, conf_dir, tmp_path):
    """parallelism.pipeline=2: stage 0 holds the input adapter (its embeddings) and reads the batch dict,
    stage 1 gets activations and the labels."""
    source = write_typed_source(tmp_path / "src", rows=300)
    cfg = with_changes(typed_config(conf_dir, tmp_path, source, name="typed-pp"),
                       parallelism={"data": 1, "pipeline": 2, "micro_batches": 2},
                       train={"epochs": 6, "optimizer": "adam", "lr": 0.01}, ps={"timeout_s": 30})
    manifest = run_etl(spark, cfg)
    result = train(spark, cfg, manifest)
    assert result.ps_stats["stages"] == 2
    assert result.history[-1]["stage0/bytes_sent"] > 0  # stage 0 ran the dict batch and sent activations
    metrics = evaluate(spark, manifest, result.spec, result.parameters, "test").metrics
    assert metrics["accuracy"] >= 0.85, metrics


def test_resume_continues_a_typed_run_from_its_checkpoint(spark, typed):
    cfg, manifest = typed
    short = with_changes(cfg, name="typed-resume", train={"epochs": 2})
    first = train(spark, short, manifest)
    resumed = train(spark, with_changes(short, train={"epochs": 4}), manifest, resume=True)
    assert resumed.resumed_from_step == first.steps
    assert resumed.steps == 2 * first.steps
    assert resumed.spec == first.spec  # the same fitted features, embeddings and all
