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


def test_plan_prints_every_candidate_for_an_assumed_cluster_without_spark(capsys, conf_dir):
    argv = ["plan", "--config", f"{conf_dir}/synthetic.yaml", "--hosts", "16", "--link-gbit", "10", "--param-mb",
            "100", "train.auto.allow=[async,compression]"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ps ") or line.startswith("| allreduce")]
    assert len(rows) == 17, out  # allreduce + 2 placements x (sync, async) x (none, fp16, bf16, topk)
    assert "N=16 ranks on 16 host(s)" in out and "M=100.000 MB" in out and "link 10 Gbit/s" in out
    driver = next(r for r in rows if r.startswith("| ps driver sync |"))
    hosts = next(r for r in rows if r.startswith("| ps hosts sync |"))
    # 16 pushes and pulls of 100 MB through the driver's one 10 Gbit/s link: each 1.28 s
    assert "push 1280.00" in driver and "pull 1280.00" in driver, driver
    assert float(hosts.split("|")[2]) < float(driver.split("|")[2]) / 4
    assert out.strip().splitlines()[-1].startswith("pick: ")


def test_plan_fixes_what_its_command_line_fixes(capsys, conf_dir):
    assert main(["plan", "--config", f"{conf_dir}/synthetic.yaml", "--hosts", "4", "--link-gbit", "1", "--param-mb",
                 "4.4", "--compute-ms", "20", "train.backend=ps", "ps.placement=driver"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ps ") or line.startswith("| allreduce")]
    assert [r.split("|")[1].strip() for r in rows] == ["ps driver sync **(pick)**"], out
    assert "compute 20.00" in rows[0]


def test_plan_without_a_shard_set_or_a_size_says_what_to_do(capsys, conf_dir, tmp_path):
    assert main(["plan", "--config", f"{conf_dir}/digits.yaml", "--hosts", "2", "--link-gbit", "1",
                 f"workdir={tmp_path}"]) == 2
    assert "run `shardline etl` first, or pass --param-mb" in capsys.readouterr().err
