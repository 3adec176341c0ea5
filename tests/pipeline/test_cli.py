import pytest

from pipeline.cli import main


def test_config_errors_exit_2_naming_the_key(capsys, conf_dir):
    assert main(["run", "--config", f"{conf_dir}/digits.yaml", "parallelism.data=0"]) == 2
    assert "parallelism.data" in capsys.readouterr().err


def test_etl_command_prints_the_shard_set(spark, capsys, conf_dir, tmp_path):
    assert main(["etl", "--config", f"{conf_dir}/digits.yaml", f"workdir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert f"shard set: {tmp_path}" in out and "train=" in out and "fingerprint: sha256:" in out


def test_evaluate_without_a_trained_model_is_a_clear_error(spark, capsys, conf_dir, tmp_path):
    assert main(["etl", "--config", f"{conf_dir}/digits.yaml", f"workdir={tmp_path}"]) == 0
    assert main(["evaluate", "--config", f"{conf_dir}/digits.yaml", f"workdir={tmp_path}"]) == 2
    assert "run `shardline train`" in capsys.readouterr().err


def test_usage_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("etl", "train", "evaluate", "run"):
        assert command in out
