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


def test_cli_logging_follows_sys_stderr_when_it_is_swapped(monkeypatch):
    import io
    import logging

    from pipeline.cli import configure_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        first = io.StringIO()
        monkeypatch.setattr("sys.stderr", first)
        configure_logging("INFO")
        first.close()  # what a test runner or a notebook cell does with the stream it handed out
        second = io.StringIO()
        monkeypatch.setattr("sys.stderr", second)
        logging.getLogger("pipeline.test").info("after the swap")
        assert "after the swap" in second.getvalue()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
