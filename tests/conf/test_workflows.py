"""The example schedules in conf/workflows/ must point at job scripts and configs that exist and load.

The Databricks job payload and the Asset Bundle's job are parsed by databricks-sdk into its typed
JobSettings (nothing may be dropped) and checked here; the Airflow DAG is read with `ast` (Airflow itself
imports it in its own lane: tests/airflow/). The checkers return a list of problems (empty when
all is well) so a failure names every broken reference at once, and the negative tests prove that a
renamed job script, a moved config or a reordered chain is caught.
"""
from __future__ import annotations

import ast
import copy
import os
import re
from pathlib import Path

import pytest
import yaml

from pipeline.config import load
from pipeline.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / "conf" / "workflows"
DATABRICKS_JOB = WORKFLOWS / "databricks_job.yml"
DATABRICKS_BUNDLE = REPO / "databricks.yml"
AIRFLOW_DAG = WORKFLOWS / "airflow_dag.py"

STEPS = ["etl", "train", "evaluate", "promote"]
# Settings every step of one schedule must agree on: train reads the shards etl wrote under workdir,
# evaluate and promote find train's model and MLflow run.
SHARED_SETTINGS = ("name", "workdir", "data.shards_dir", "tracking.uri", "tracking.experiment",
                   "tracking.registered_model", "parallelism.data")


# ----------------------------------------------------------------------------------------- helpers

def linear_order(nodes: list[str], edges: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(nodes from first to last, problems) for edges (before, after) that must form one straight chain."""
    problems = []
    unknown = sorted({n for edge in edges for n in edge} - set(nodes))
    if unknown:
        problems.append(f"dependencies name unknown tasks {unknown}")
    successors: dict[str, list[str]] = {n: [] for n in nodes}
    predecessors: dict[str, list[str]] = {n: [] for n in nodes}
    for before, after in edges:
        if before in successors and after in predecessors:
            successors[before].append(after)
            predecessors[after].append(before)
    for n in nodes:
        if len(successors[n]) > 1 or len(predecessors[n]) > 1:
            problems.append(f"task {n!r} is not on a single chain (before: {predecessors[n]}, after: {successors[n]})")
    roots = [n for n in nodes if not predecessors[n]]
    if len(roots) != 1:
        problems.append(f"expected exactly one first task, found {roots}")
        return [], problems
    order, current = [], roots[0]
    while current is not None and current not in order:
        order.append(current)
        current = successors[current][0] if successors[current] else None
    if len(order) != len(nodes):
        problems.append(f"the dependency chain {order} does not reach every task {nodes}")
    return order, problems


def config_invocation(args: list, base_dir: Path) -> tuple[Path | None, list[str], list[str]]:
    """(config path, overrides, problems) from job arguments `--config PATH key=value ...`."""
    problems, config, overrides = [], None, []
    args = [str(a) for a in args]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config", "-c"):
            if i + 1 >= len(args):
                problems.append("--config without a value")
                break
            config = (base_dir / args[i + 1]).resolve()
            i += 2
            continue
        if arg.startswith("--config="):
            config = (base_dir / arg.split("=", 1)[1]).resolve()
        elif arg.startswith("-"):
            pass  # --resume, --log-level, ...: not ours to check
        elif "=" in arg:
            overrides.append(arg)
        else:
            problems.append(f"unexpected argument {arg!r} (expected --config PATH and key.sub=value overrides)")
        i += 1
    if config is None:
        problems.append(f"no --config in {args}")
    return config, overrides, problems


def load_step_config(step: str, args: list, base_dir: Path):
    """(resolved PipelineConfig or None, problems) for one step's arguments; paths relative to base_dir."""
    config, overrides, problems = config_invocation(args, base_dir)
    if config is None:
        return None, [f"{step}: {p}" for p in problems]
    if not config.is_file():
        problems.append(f"config {config} does not exist")
        return None, [f"{step}: {p}" for p in problems]
    if REPO not in config.parents:
        problems.append(f"config {config} is outside the repository")
    try:
        cfg = load(config, overrides)
    except ConfigError as exc:
        problems.append(f"config {config} with {overrides} does not load: {exc}")
        cfg = None
    return cfg, [f"{step}: {p}" for p in problems]


def setting(cfg, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def check_steps_agree(configs: dict) -> list[str]:
    problems = []
    loaded = {step: cfg for step, cfg in configs.items() if cfg is not None}
    for key in SHARED_SETTINGS:
        values = {step: setting(cfg, key) for step, cfg in loaded.items()}
        if len(set(map(repr, values.values()))) > 1:
            problems.append(f"steps disagree on {key}: {values}")
    return problems


def check_job_script(path: Path, what: str) -> list[str]:
    problems = []
    if not path.is_file():
        problems.append(f"{what}: job script {path} does not exist")
    elif path.parent != REPO / "jobs":
        problems.append(f"{what}: {path} is not one of the repository's jobs/*.py scripts")
    return problems


# ------------------------------------------------------------------------------- Databricks job

def databricks_problems(job: dict, bundle: bool = False) -> list[str]:
    """Everything wrong with a Jobs API 2.1 job-settings payload (as loaded from the YAML); ``bundle``: the
    job of a Databricks Asset Bundle, whose python_files are workspace files relative to the bundle root."""
    problems = []
    tasks = job.get("tasks") or []
    by_key = {t.get("task_key"): t for t in tasks}
    if len(by_key) != len(tasks) or None in by_key:
        problems.append(f"task_key missing or repeated: {[t.get('task_key') for t in tasks]}")

    # The chain, from depends_on, in terms of the scripts the tasks run.
    edges = [(dep.get("task_key"), t.get("task_key")) for t in tasks for dep in t.get("depends_on") or []]
    order, chain_problems = linear_order(list(by_key), edges)
    problems += chain_problems
    step_of = {}
    for key, task in by_key.items():
        spt = task.get("spark_python_task")
        if not spt:
            problems.append(f"task {key!r} is not a spark_python_task")
            continue
        python_file = spt.get("python_file", "")
        step_of[key] = Path(python_file).stem
        if bundle and (spt.get("source") or job.get("git_source")):
            problems.append(f"task {key!r}: a bundle deploys the scripts itself; drop source/git_source")
        elif not bundle and (spt.get("source") != "GIT" or not job.get("git_source")):
            problems.append(f"task {key!r}: expected source: GIT and a git_source (paths relative to the repo)")
        if os.path.isabs(python_file):
            problems.append(f"task {key!r}: a Git-sourced python_file must be relative, got {python_file!r}")
        script = (REPO / python_file).resolve()
        problems += check_job_script(script, f"task {key!r}")
    if not chain_problems and [step_of.get(k) for k in order] != STEPS:
        problems.append(f"the tasks run {[step_of.get(k) for k in order]} in dependency order, expected {STEPS}")

    # Configs: on Databricks Runtime 14+ a script's working directory is its own folder.
    configs = {}
    for key, task in by_key.items():
        spt = task.get("spark_python_task") or {}
        script_dir = (REPO / spt.get("python_file", "")).parent
        configs[key], config_problems = load_step_config(key, spt.get("parameters") or [], script_dir)
        problems += config_problems
        if not task.get("libraries"):
            problems.append(f"task {key!r} installs no library (the shardline wheel)")
    problems += check_steps_agree(configs)

    # Schedule.
    cron = (job.get("schedule") or {}).get("quartz_cron_expression", "")
    if len(cron.split()) not in (6, 7):
        problems.append(f"schedule.quartz_cron_expression {cron!r} is not a 6-7 field Quartz cron")
    if not (job.get("schedule") or {}).get("timezone_id"):
        problems.append("schedule.timezone_id is missing")

    # Clusters: what barrier training needs.
    clusters = {c.get("job_cluster_key"): c.get("new_cluster") or {} for c in job.get("job_clusters") or []}
    for key, task in by_key.items():
        cluster = clusters.get(task.get("job_cluster_key"))
        if cluster is None:
            problems.append(f"task {key!r} uses job cluster {task.get('job_cluster_key')!r}, which is not defined")
            continue
        spark_conf = cluster.get("spark_conf") or {}
        if str(spark_conf.get("spark.dynamicAllocation.enabled", "")).lower() != "false":
            problems.append(f"task {key!r}: its cluster must set spark.dynamicAllocation.enabled: \"false\"")
        if "autoscale" in cluster:
            problems.append(f"task {key!r}: its cluster autoscales; barrier training needs a fixed num_workers")
        workers = cluster.get("num_workers") or 0
        cfg = configs.get(key)
        # Each worker node gives at least one slot at spark.task.cpus=1: a lower bound that always holds.
        if cfg is not None and int(spark_conf.get("spark.task.cpus", 1)) == 1 and workers < cfg.parallelism.data:
            problems.append(f"task {key!r}: num_workers={workers} may give fewer task slots than "
                            f"parallelism.data={cfg.parallelism.data}")
    return problems


@pytest.fixture(scope="module")
def databricks_job() -> dict:
    return yaml.safe_load(DATABRICKS_JOB.read_text())


def test_databricks_job_is_valid(databricks_job):
    assert databricks_problems(databricks_job) == []


def test_databricks_job_chain_and_schedule(databricks_job):
    tasks = {t["task_key"]: t for t in databricks_job["tasks"]}
    order, problems = linear_order(list(tasks), [(d["task_key"], k) for k, t in tasks.items()
                                                 for d in t.get("depends_on") or []])
    assert problems == [] and order == STEPS
    assert [tasks[k]["spark_python_task"]["python_file"] for k in order] == [f"jobs/{s}.py" for s in STEPS]
    assert len(databricks_job["schedule"]["quartz_cron_expression"].split()) in (6, 7)
    for cluster in databricks_job["job_clusters"]:
        assert cluster["new_cluster"]["spark_conf"]["spark.dynamicAllocation.enabled"] == "false"


def test_databricks_checker_catches_a_renamed_script(databricks_job):
    job = copy.deepcopy(databricks_job)
    job["tasks"][0]["spark_python_task"]["python_file"] = "jobs/etl_renamed.py"
    problems = databricks_problems(job)
    assert any("etl_renamed.py does not exist" in p for p in problems), problems


def test_databricks_checker_catches_a_missing_config_and_a_bad_override(databricks_job):
    job = copy.deepcopy(databricks_job)
    job["tasks"][1]["spark_python_task"]["parameters"] = ["--config", "../conf/nope.yaml"]
    job["tasks"][2]["spark_python_task"]["parameters"] = (
        list(job["tasks"][2]["spark_python_task"]["parameters"]) + ["train.epochz=3"])
    problems = databricks_problems(job)
    assert any(p.startswith("train: config") and "nope.yaml does not exist" in p for p in problems), problems
    assert any(p.startswith("evaluate: config") and "train.epochz" in p for p in problems), problems


def test_databricks_checker_catches_a_reordered_chain_and_dynamic_allocation(databricks_job):
    job = copy.deepcopy(databricks_job)
    tasks = {t["task_key"]: t for t in job["tasks"]}
    tasks["train"]["depends_on"] = [{"task_key": "evaluate"}]
    tasks["evaluate"]["depends_on"] = [{"task_key": "etl"}]
    tasks["promote"]["depends_on"] = [{"task_key": "train"}]
    job["job_clusters"][0]["new_cluster"]["spark_conf"]["spark.dynamicAllocation.enabled"] = "true"
    job["schedule"]["quartz_cron_expression"] = "0 2 * * *"  # Unix cron, not Quartz
    problems = databricks_problems(job)
    assert any("expected ['etl', 'train', 'evaluate', 'promote']" in p for p in problems), problems
    assert any("spark.dynamicAllocation.enabled" in p for p in problems), problems
    assert any("quartz_cron_expression" in p for p in problems), problems


# ---------------------------------------------------------------------------------- Airflow DAG

class Unknown:
    """A value the restricted evaluator could not compute (fine unless a checked field needs it)."""

    def __init__(self, node: ast.AST):
        self.text = ast.unparse(node)

    def __repr__(self):
        return f"<not evaluated: {self.text}>"


def evaluate(node: ast.AST, env: dict):
    """Constants, names, lists/tuples/dicts (with * and **), str/list +, f-strings, os.path.join,
    os.environ.get (its default) and dict(...); anything else is Unknown."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env.get(node.id, Unknown(node))
    if isinstance(node, (ast.List, ast.Tuple)):
        out = []
        for elt in node.elts:
            if isinstance(elt, ast.Starred):
                value = evaluate(elt.value, env)
                if isinstance(value, Unknown):
                    return value
                out.extend(value)
            else:
                out.append(evaluate(elt, env))
        return out
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values):
            if key is None:  # **mapping
                merged = evaluate(value, env)
                if not isinstance(merged, dict):
                    return Unknown(node)
                out.update(merged)
            else:
                out[evaluate(key, env)] = evaluate(value, env)
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = evaluate(node.left, env), evaluate(node.right, env)
        if isinstance(left, Unknown) or isinstance(right, Unknown) or type(left) is not type(right):
            return Unknown(node)
        return left + right
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            part = evaluate(value.value, env) if isinstance(value, ast.FormattedValue) else value.value
            if isinstance(part, Unknown) or (isinstance(value, ast.FormattedValue) and value.format_spec):
                return Unknown(node)
            parts.append(str(part))
        return "".join(parts)
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        args = [evaluate(a, env) for a in node.args]
        kwargs = call_kwargs(node, env)
        if any(isinstance(a, Unknown) for a in args) or isinstance(kwargs, Unknown):
            return Unknown(node)
        if name == "os.path.join" and all(isinstance(a, str) for a in args):
            return os.path.join(*args)
        if name == "os.environ.get" and len(args) == 2:
            return args[1]
        if name == "dict" and not args:
            return kwargs
    return Unknown(node)


def call_kwargs(call: ast.Call, env: dict):
    out = {}
    for kw in call.keywords:
        value = evaluate(kw.value, env)
        if kw.arg is None:  # **mapping
            if not isinstance(value, dict):
                return Unknown(call)
            out.update(value)
        else:
            out[kw.arg] = value
    return out


def chain_edges(node: ast.AST) -> tuple[list[str], list[tuple[str, str]]]:
    """(the tasks the expression evaluates to, edges) of `a >> b >> c` / `c << b << a`; lists fan out.

    As in Airflow, `x >> y` and `x << y` evaluate to y, so `a >> b >> c` is `(a >> b) >> c`: b >> c."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.RShift, ast.LShift)):
        left, left_edges = chain_edges(node.left)
        right, right_edges = chain_edges(node.right)
        pairs = [(a, b) for a in left for b in right]
        if isinstance(node.op, ast.LShift):
            pairs = [(b, a) for a, b in pairs]
        return right, left_edges + right_edges + pairs
    if isinstance(node, ast.Name):
        return [node.id], []
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.id for e in node.elts if isinstance(e, ast.Name)], []
    return [], []


def read_dag(source: str, repo: Path = REPO) -> tuple[dict, list[tuple[str, str]]]:
    """({variable: operator kwargs}, task edges as (variable, variable)) from the DAG's source.

    Statements run top to bottom through `with` blocks; REPO is pinned to this checkout."""
    env: dict = {}
    operators: dict[str, dict] = {}
    edges: list[tuple[str, str]] = []

    def visit(body):
        for stmt in body:
            if isinstance(stmt, ast.With):
                visit(stmt.body)
            elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                target = stmt.targets[0].id
                if target == "REPO":
                    env[target] = str(repo)
                elif isinstance(stmt.value, ast.Call) and ast.unparse(stmt.value.func).endswith("SparkSubmitOperator"):
                    kwargs = call_kwargs(stmt.value, env)
                    operators[target] = kwargs if isinstance(kwargs, dict) else {"<unevaluated>": kwargs}
                else:
                    env[target] = evaluate(stmt.value, env)
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.BinOp):
                edges.extend(chain_edges(stmt.value)[1])

    visit(ast.parse(source).body)
    if "REPO" not in env:
        raise AssertionError("the DAG defines no REPO constant; its job paths cannot be resolved")
    return operators, edges


def airflow_problems(source: str) -> list[str]:
    problems = []
    operators, edges = read_dag(source)
    task_ids = {var: kw.get("task_id") for var, kw in operators.items()}
    if len(operators) != len(STEPS):
        problems.append(f"expected {len(STEPS)} SparkSubmitOperator tasks, found {sorted(operators)}")
    order, chain_problems = linear_order(list(operators), edges)
    problems += chain_problems
    if not chain_problems and [task_ids[v] for v in order] != STEPS:
        problems.append(f"the >> chain runs {[task_ids[v] for v in order]}, expected {STEPS}")

    configs = {}
    for var, kw in operators.items():
        step = task_ids[var] or var
        bad = {k: v for k, v in kw.items() if isinstance(v, Unknown)}
        checked = {"task_id", "application", "application_args", "conf", "num_executors", "executor_cores",
                   "deploy_mode"}
        if bad.keys() & checked:
            problems.append(f"{step}: cannot evaluate {sorted(bad.keys() & checked)} statically: {bad}")
            continue
        application = kw.get("application")
        if not isinstance(application, str):
            problems.append(f"{step}: no application")
            continue
        problems += check_job_script(Path(application), f"task {step!r}")
        if Path(application).stem != step:
            problems.append(f"task {step!r} runs {application}")
        configs[step], config_problems = load_step_config(step, kw.get("application_args") or [], REPO)
        problems += config_problems
        if kw.get("deploy_mode") != "client":
            problems.append(f"{step}: deploy_mode must be 'client' (the --config path is read on the driver, "
                            f"here), got {kw.get('deploy_mode')!r}")
        conf = kw.get("conf") or {}
        if str(conf.get("spark.dynamicAllocation.enabled", "")).lower() != "false":
            problems.append(f"{step}: conf must set spark.dynamicAllocation.enabled='false'")
        cfg = configs[step]
        if cfg is not None:
            slots = (int(kw.get("num_executors") or 0) * int(kw.get("executor_cores") or 0)
                     // int(conf.get("spark.task.cpus", 1)))
            if slots < cfg.parallelism.data:
                problems.append(f"{step}: num_executors x executor_cores / spark.task.cpus = {slots} task slots "
                                f"< parallelism.data={cfg.parallelism.data}")
    problems += check_steps_agree(configs)
    return problems


@pytest.fixture(scope="module")
def dag_source() -> str:
    return AIRFLOW_DAG.read_text()


def test_airflow_dag_is_valid(dag_source):
    assert airflow_problems(dag_source) == []


def test_airflow_dag_settings(dag_source):
    tree = ast.parse(dag_source)
    imports = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and node.module == "airflow.providers.apache.spark.operators.spark_submit" for alias in node.names}
    assert "SparkSubmitOperator" in imports
    dag_calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) == "DAG"]
    assert len(dag_calls) == 1
    dag_kwargs = {kw.arg: kw.value for kw in dag_calls[0].keywords}
    assert ast.literal_eval(dag_kwargs["catchup"]) is False
    assert ast.literal_eval(dag_kwargs["schedule"]) == "@daily"
    assert evaluate(dag_kwargs["default_args"], {})["retries"] >= 1
    operators, _ = read_dag(dag_source)
    assert sorted(kw["task_id"] for kw in operators.values()) == sorted(STEPS)
    for kw in operators.values():
        assert kw["application"] == str(REPO / "jobs" / f"{kw['task_id']}.py")


def test_airflow_checker_catches_a_renamed_script(dag_source):
    renamed = dag_source.replace('"evaluate.py"', '"evaluate_v2.py"')
    assert renamed != dag_source
    problems = airflow_problems(renamed)
    assert any("evaluate_v2.py does not exist" in p for p in problems), problems


def test_airflow_checker_catches_a_moved_config_and_a_broken_chain(dag_source):
    broken = dag_source.replace('"digits.yaml"', '"digits_old.yaml"')
    broken = broken.replace("etl >> train >> evaluate >> promote", "etl >> evaluate >> train >> promote")
    assert broken.count("digits_old.yaml") == 1 and "etl >> evaluate >> train" in broken
    problems = airflow_problems(broken)
    assert any("digits_old.yaml does not exist" in p for p in problems), problems
    assert any("the >> chain runs ['etl', 'evaluate', 'train', 'promote']" in p for p in problems), problems


def test_airflow_checker_catches_dynamic_allocation_and_too_few_slots(dag_source):
    broken = dag_source.replace('"spark.dynamicAllocation.enabled": "false"',
                                '"spark.dynamicAllocation.enabled": "true"')
    broken = broken.replace('"parallelism.data=2"', '"parallelism.data=8"')
    problems = airflow_problems(broken)
    assert any("spark.dynamicAllocation.enabled" in p for p in problems), problems
    assert any("< parallelism.data=8" in p for p in problems), problems


def test_every_job_script_the_examples_mention_exists():
    """Comments and docstrings point at scripts too (jobs/workflow.py as the single-task alternative)."""
    for path in (DATABRICKS_JOB, AIRFLOW_DAG):
        mentioned = set(re.findall(r"\bjobs/\w+\.py\b", path.read_text()))
        assert mentioned, path
        missing = sorted(m for m in mentioned if not (REPO / m).is_file())
        assert missing == [], f"{path.name} mentions job scripts that do not exist: {missing}"


def test_chain_reader_follows_operator_precedence():
    _, edges = chain_edges(ast.parse("a >> b >> [c, d]").body[0].value)
    assert sorted(edges) == [("a", "b"), ("b", "c"), ("b", "d")]
    _, edges = chain_edges(ast.parse("c << b << a").body[0].value)
    order, problems = linear_order(["a", "b", "c"], edges)
    assert problems == [] and order == ["a", "b", "c"]


# ----------------------------------------------------------------- databricks-sdk and the Asset Bundle

def sdk_round_trip_losses(payload: dict) -> list[str]:
    """Keys databricks-sdk's typed JobSettings drops or changes: a misspelt or misplaced key is one."""
    from databricks.sdk.service.jobs import JobSettings

    back = JobSettings.from_dict(payload).as_dict()
    losses: list[str] = []

    def walk(a, b, path):
        if isinstance(a, dict):
            for key in a:
                if not isinstance(b, dict) or key not in b:
                    losses.append(f"{path}.{key}")
                else:
                    walk(a[key], b[key], f"{path}.{key}")
        elif isinstance(a, list):
            if not isinstance(b, list) or len(a) != len(b):
                losses.append(path)
            else:
                for i, (x, y) in enumerate(zip(a, b)):
                    walk(x, y, f"{path}[{i}]")
        elif a != b:
            losses.append(f"{path} ({a!r} -> {b!r})")

    walk(payload, back, "job")
    return losses


def bundle_job(bundle: dict, name: str = "nightly") -> dict:
    """resources.jobs.<name> with ${var.X} replaced by the variables' defaults, as `bundle deploy` does."""
    variables = {key: spec["default"] for key, spec in (bundle.get("variables") or {}).items()}

    def substitute(value):
        if isinstance(value, str):
            return re.sub(r"\$\{var\.([A-Za-z_]\w*)\}", lambda m: str(variables[m.group(1)]), value)
        if isinstance(value, list):
            return [substitute(v) for v in value]
        if isinstance(value, dict):
            return {k: substitute(v) for k, v in value.items()}
        return value

    return substitute(copy.deepcopy(bundle["resources"]["jobs"][name]))


@pytest.fixture(scope="module")
def bundle() -> dict:
    return yaml.safe_load(DATABRICKS_BUNDLE.read_text())


def test_databricks_job_parses_into_the_sdks_typed_settings_with_nothing_dropped(databricks_job):
    from databricks.sdk.service.jobs import JobSettings, Source

    assert sdk_round_trip_losses(databricks_job) == []
    settings = JobSettings.from_dict(databricks_job)
    assert [t.task_key for t in settings.tasks] == STEPS
    assert {t.spark_python_task.source for t in settings.tasks} == {Source.GIT}
    assert settings.max_concurrent_runs == 1


def test_sdk_parse_catches_a_misplaced_key(databricks_job):
    job = copy.deepcopy(databricks_job)
    job["tasks"][0]["spark_python_task"]["python_flie"] = job["tasks"][0]["spark_python_task"].pop("python_file")
    assert "job.tasks[0].spark_python_task.python_flie" in sdk_round_trip_losses(job)


def test_asset_bundle_job_is_the_same_job_and_valid(bundle, databricks_job):
    from databricks.sdk.service.jobs import JobSettings

    assert bundle["bundle"]["name"] and {"dev", "prod"} <= set(bundle["targets"])
    assert sum(bool(t.get("default")) for t in bundle["targets"].values()) == 1
    job = bundle_job(bundle)
    assert "${" not in str(job), "a ${var.*} reference names no variable"
    assert sdk_round_trip_losses(job) == []
    assert databricks_problems(job, bundle=True) == []
    settings = JobSettings.from_dict(job)
    assert [t.task_key for t in settings.tasks] == STEPS
    # The same steps, parameters and cluster as the plain payload (only where the code comes from differs).
    plain = {t["task_key"]: t for t in databricks_job["tasks"]}
    for task in job["tasks"]:
        other = plain[task["task_key"]]
        assert task["spark_python_task"]["python_file"] == other["spark_python_task"]["python_file"]
        assert task["spark_python_task"]["parameters"] == other["spark_python_task"]["parameters"]
        assert task.get("max_retries") == other.get("max_retries")
    assert job["job_clusters"][0]["new_cluster"]["spark_conf"] == \
        databricks_job["job_clusters"][0]["new_cluster"]["spark_conf"]
    wheel = bundle["artifacts"]["shardline_wheel"]
    assert wheel["type"] == "whl" and (REPO / wheel["path"] / "pyproject.toml").is_file()
    assert all(lib == {"whl": "./dist/*.whl"} for t in job["tasks"] for lib in t["libraries"])
