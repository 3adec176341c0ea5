"""A multi-host Spark standalone cluster on one machine: every worker "host" is a network namespace.

    root namespace                      namespace <prefix>h1             namespace <prefix>h2
    bridge <prefix>br 198.18.S.1/24 ── veth ── eth0 198.18.S.11      ── eth0 198.18.S.12 ...
      Spark master, spark-submit's driver, the S3 server (moto), all bound to 198.18.S.1

Each namespace is a machine of its own to the processes in it: its own host name and its own /dev/shm
(so no "same host" shortcut, shared-memory rings or allreduce, is taken between hosts).
Each worker's traffic to the driver, the master, the S3 server or another worker crosses real TCP
through its veth link and the bridge, so `tc tbf` on a link limits its rate and `ip link set ... down`
cuts the host off. The hosts share no disk by configuration: the runs put every path they share (raw
data, shards, checkpoints, the model) on the S3 server, each worker gets its own work and local dirs, and
the executors' Python has no `pipeline` of its own (it gets the wheel spark-submit ships in --py-files).

Why our own and not ../shared/tools/netns_cluster.sh: the fixture needs names and a subnet of its own
(two testbeds never collide), the daemons' pids to stop them by, and teardown in `finally`.

By hand, from the checkout (root; `make install` first):

    .venv/bin/python -m tests.cluster.testbed up --hosts 2      # prints the master URL and the state folder
    .venv/bin/python -m tests.cluster.testbed submit -- jobs/run_pipeline.py --config conf/digits.yaml ...
    .venv/bin/python -m tests.cluster.testbed shape --rate 1gbit | cut 1 | heal 1 | power-off 1 | counters
    .venv/bin/python -m tests.cluster.testbed down
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from tests.cluster.shipping import build_wheel, make_executor_python

REPO = Path(__file__).resolve().parents[2]
STATE_FILE = "testbed.json"
# The RFC 2544 benchmarking range: never routed, so nothing can leave the machine by mistake.
SUBNET_BASE = "198.18"
MASTER_PORT = 7077


class TestbedUnavailable(RuntimeError):
    """This machine cannot build the testbed (no CAP_NET_ADMIN, no `ip`): the tests skip with this text."""


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> Optional[str]:
    """Why this machine cannot run the testbed, or None when it can (it tries a throwaway bridge)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2's `ip` and `tc` are not installed"
    if os.geteuid() != 0:
        return "the multi-host testbed needs root (CAP_NET_ADMIN) to create network namespaces"
    probe = f"slprobe{os.getpid() % 100000}"
    made = _run("ip", "link", "add", probe, "type", "bridge", check=False)
    if made.returncode != 0:
        return f"cannot create a bridge (no CAP_NET_ADMIN?): {made.stderr.strip()}"
    _run("ip", "link", "del", probe, check=False)
    return None


@dataclass
class Host:
    index: int  # 1-based
    netns: str
    veth: str  # the root-namespace end of its link (the bridge port); the namespace end is eth0
    address: str
    worker_dir: str
    local_dir: str
    pid: Optional[int] = None

    @property
    def hostname(self) -> str:
        return self.netns


@dataclass
class Testbed:
    """A running testbed (`up()` starts it, `down()` always stops it); its state is a JSON file in `root`,
    so the command line can drive a testbed that another process started."""

    root: str
    prefix: str
    subnet: int
    python: str  # the driver's interpreter (the checkout's venv)
    executor_python: str = ""  # an interpreter with the same packages but no `pipeline` of its own
    hosts: list[Host] = field(default_factory=list)
    master_pid: Optional[int] = None
    s3_pid: Optional[int] = None
    s3_endpoint: str = ""
    bucket: str = "shardline-cluster"
    wheel: str = ""
    bridge: str = ""

    # -- addresses ---------------------------------------------------------------------------------
    @property
    def driver_address(self) -> str:
        return f"{SUBNET_BASE}.{self.subnet}.1"

    @property
    def master_url(self) -> str:
        return f"spark://{self.driver_address}:{MASTER_PORT}"

    @property
    def spark_home(self) -> str:
        return str(Path(subprocess.check_output(
            [self.python, "-c", "import pyspark, os; print(os.path.dirname(pyspark.__file__))"], text=True).strip()))

    def host(self, index: int) -> Host:
        return self.hosts[index - 1]

    def host_of(self, address: str) -> Optional[Host]:
        return next((h for h in self.hosts if h.address == address), None)

    def s3_env(self) -> dict:
        from tests.s3_server import env_for

        return env_for(self.s3_endpoint)

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *[p.strip("/") for p in parts]])

    # -- lifecycle ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, hosts: int, root: Optional[str] = None, python: Optional[str] = None) -> "Testbed":
        reason = unavailable_reason()
        if reason:
            raise TestbedUnavailable(reason)
        token = os.getpid() % 1000
        root = root or tempfile.mkdtemp(prefix="sl-testbed-")
        bed = cls(root=str(root), prefix=f"sl{token}", subnet=_free_subnet(), python=python or sys.executable)
        bed.bridge = f"{bed.prefix}br"
        bed.hosts = [Host(i, f"{bed.prefix}h{i}", f"{bed.prefix}v{i}", f"{SUBNET_BASE}.{bed.subnet}.{10 + i}",
                          str(Path(root) / f"host{i}" / "work"), str(Path(root) / f"host{i}" / "local"))
                     for i in range(1, hosts + 1)]
        return bed

    def up(self, cores: int = 1, memory: str = "1g") -> "Testbed":
        """Network, S3 server, executor Python, wheel, master, one worker per host. Half-started state is
        saved as it is made, so `down()` removes it whatever failed."""
        Path(self.root).mkdir(parents=True, exist_ok=True)
        self._save()
        self._network()
        self._start_s3()
        self.executor_python = make_executor_python(self.python, Path(self.root) / "executor-venv")
        self.wheel = str(build_wheel(Path(self.root) / "dist"))
        self._start_master()
        for host in self.hosts:
            self._start_worker(host, cores, memory)
        self._save()
        self.wait_workers(len(self.hosts))
        return self

    def down(self) -> None:
        """Stop every daemon by its own pid (and whatever else runs in the namespaces), remove the links,
        the namespaces and the bridge. Never raises: it runs in `finally`."""
        _kill_trees([h.pid for h in self.hosts] + [self.master_pid, self.s3_pid])
        _kill_trees([pid for host in self.hosts for pid in _netns_pids(host.netns)])
        for host in self.hosts:
            _run("ip", "netns", "del", host.netns, check=False)
            shutil.rmtree(Path("/etc/netns", host.netns), ignore_errors=True)
            _run("ip", "link", "del", host.veth, check=False)
        if self.bridge:
            _run("ip", "link", "del", self.bridge, check=False)
        for host in self.hosts:
            host.pid = None
        self.master_pid = self.s3_pid = None
        self._save()

    def __enter__(self) -> "Testbed":
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()

    def _save(self) -> None:
        Path(self.root, STATE_FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, root: str) -> "Testbed":
        state = json.loads(Path(root, STATE_FILE).read_text())
        state["hosts"] = [Host(**h) for h in state["hosts"]]
        return cls(**state)

    # -- pieces of up() ------------------------------------------------------------------------------
    def _network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.driver_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for host in self.hosts:
            _run("ip", "netns", "add", host.netns)
            _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _run("ip", "link", "set", host.veth, "master", self.bridge)
            _run("ip", "link", "set", host.veth, "up")
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", host.netns, "link", "set", "eth0", "up")
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
            _run("ip", "-n", host.netns, "route", "add", "default", "via", self.driver_address)

    def _log(self, name: str):
        return open(Path(self.root, f"{name}.log"), "ab")

    def _start_s3(self) -> None:
        port = _free_port(self.driver_address)
        self.s3_endpoint = f"http://{self.driver_address}:{port}"
        with self._log("s3") as log:
            self.s3_pid = subprocess.Popen([self.python, "-m", "moto.server", "-H", self.driver_address, "-p",
                                            str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                           start_new_session=True).pid
        self._save()
        _wait(lambda: _http_ok(f"{self.s3_endpoint}/moto-api/"), 30, "the S3 server", Path(self.root, "s3.log"))
        import pyarrow.fs as pafs

        keys = self.s3_env()
        pafs.S3FileSystem(endpoint_override=f"{self.driver_address}:{port}", scheme="http", region="us-east-1",
                          access_key=keys["AWS_ACCESS_KEY_ID"], secret_key=keys["AWS_SECRET_ACCESS_KEY"],
                          allow_bucket_creation=True).create_dir(self.bucket)

    def _spark_env(self, address: str, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
        return {**env, "SPARK_HOME": self.spark_home, "SPARK_LOCAL_IP": address, "JAVA_TOOL_OPTIONS": "",
                "SPARK_NO_DAEMONIZE": "1", **extra}

    def _start_master(self) -> None:
        with self._log("master") as log:
            self.master_pid = subprocess.Popen(
                [f"{self.spark_home}/bin/spark-class", "org.apache.spark.deploy.master.Master", "--host",
                 self.driver_address, "--port", str(MASTER_PORT), "--webui-port", str(_free_port(self.driver_address))],
                stdout=log, stderr=subprocess.STDOUT, env=self._spark_env(self.driver_address), cwd=self.root,
                start_new_session=True).pid
        self._save()
        _wait(lambda: "I have been elected leader" in _read(Path(self.root, "master.log")), 90, "the Spark master",
              Path(self.root, "master.log"))

    def _start_worker(self, host: Host, cores: int, memory: str) -> None:
        for folder in (host.worker_dir, host.local_dir):
            Path(folder).mkdir(parents=True, exist_ok=True)
        env = self._spark_env(host.address, SPARK_WORKER_DIR=host.worker_dir, SPARK_LOCAL_DIRS=host.local_dir,
                              **self.s3_env())
        with self._log(f"worker{host.index}") as log:
            host.pid = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, *self._own_machine(host), f"{self.spark_home}/bin/spark-class",
                 "org.apache.spark.deploy.worker.Worker", "--host", host.address, "--cores", str(cores),
                 "--memory", memory, "--work-dir", host.worker_dir, "--webui-port", "0", self.master_url],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=host.worker_dir, start_new_session=True).pid
        self._save()

    def _own_machine(self, host: Host) -> list[str]:
        """What makes a namespace a machine of its own besides its network: its host name (UTS namespace,
        resolvable through /etc/netns/<ns>/hosts, which `ip netns exec` mounts over /etc/hosts) and its own
        /dev/shm (a mount namespace with a fresh tmpfs). Without them every "host" has the same name, boot
        id and /dev/shm, and the allreduce took its one-host shared-memory path across the hosts: the
        network bench measured 20 ms steps for 4.5 MB at 200 Mbit/s, no byte on the links."""
        etc = Path("/etc/netns", host.netns)
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{host.address} {host.hostname}\n")
        return ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
                f'hostname {host.hostname} && mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"', "sh"]

    def wait_workers(self, count: int, timeout_s: float = 90) -> None:
        log = Path(self.root, "master.log")
        _wait(lambda: _read(log).count("Registering worker") >= count, timeout_s,
              f"{count} Spark worker(s) registering with the master", log)

    # -- runs ----------------------------------------------------------------------------------------
    def submit_command(self, *args: str, executors: Optional[int] = None, conf: Sequence[str] = ()) -> list[str]:
        """spark-submit in client mode from the root namespace, the driver on the bridge address, the wheel
        in --py-files and the executors on the interpreter that has no `pipeline` of its own."""
        executors = len(self.hosts) if executors is None else executors
        spark_conf = {"spark.driver.host": self.driver_address, "spark.driver.bindAddress": self.driver_address,
                      "spark.executor.cores": "1", "spark.cores.max": str(executors), "spark.executor.memory": "768m",
                      "spark.pyspark.python": self.executor_python, "spark.pyspark.driver.python": self.python,
                      "spark.ui.enabled": "false", "spark.dynamicAllocation.enabled": "false"}
        for item in conf:
            key, value = item.split("=", 1)
            spark_conf[key] = value
        command = [f"{self.spark_home}/bin/spark-submit", "--master", self.master_url, "--py-files", self.wheel]
        for key, value in spark_conf.items():
            command += ["--conf", f"{key}={value}"]
        return command + list(args)

    def submit_env(self) -> dict:
        return {**self._spark_env(self.driver_address), **self.s3_env(), "PYSPARK_PYTHON": self.executor_python,
                "PYSPARK_DRIVER_PYTHON": self.python, "MLFLOW_DISABLE_TELEMETRY": "true"}

    # -- faults and shaping ----------------------------------------------------------------------------
    def shape(self, rate: Optional[str], burst: str = "256kb", latency: str = "100ms") -> None:
        """`tc tbf` at `rate` on both ends of every worker link (None: remove it)."""
        for host in self.hosts:
            for ns in (None, host.netns):
                dev = "eth0" if ns else host.veth
                base = ["ip", "netns", "exec", ns, "tc"] if ns else ["tc"]
                if rate is None:
                    _run(*base, "qdisc", "del", "dev", dev, "root", check=False)
                else:
                    _run(*base, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                         "latency", latency)

    def cut(self, index: int) -> None:
        """Take host `index`'s link down: its processes live on, but nothing reaches them (no FIN, no RST)."""
        _run("ip", "link", "set", self.host(index).veth, "down")

    def heal(self, index: int) -> None:
        _run("ip", "link", "set", self.host(index).veth, "up")

    def power_off(self, index: int) -> list[int]:
        """SIGKILL every process in host `index`'s namespace (its worker, executors, Python workers)."""
        pids = _netns_pids(self.host(index).netns)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.host(index).pid = None
        self._save()
        return pids

    def revive(self, index: int, cores: int = 1, memory: str = "1g") -> None:
        """Power host `index` back on: its link up and a fresh Spark worker registered with the master."""
        self.heal(index)
        registered = _read(Path(self.root, "master.log")).count("Registering worker")
        self._start_worker(self.host(index), cores, memory)
        self.wait_workers(registered + 1)

    def driver_counters(self) -> dict[str, int]:
        """The bridge's own counters: traffic to and from the root namespace (the driver, the master, the
        S3 server), not what the bridge forwards between hosts. tx = towards the hosts."""
        stats = Path("/sys/class/net", self.bridge, "statistics")
        return {"tx_bytes": int((stats / "tx_bytes").read_text()), "rx_bytes": int((stats / "rx_bytes").read_text())}

    def counters(self) -> dict[str, dict[str, int]]:
        """Each worker link's byte counters, as the root-namespace end sees them: tx = towards the host."""
        out = {}
        for host in self.hosts:
            stats = Path("/sys/class/net", host.veth, "statistics")
            out[host.address] = {"tx_bytes": int((stats / "tx_bytes").read_text()),
                                 "rx_bytes": int((stats / "rx_bytes").read_text())}
        return out


# -- helpers ---------------------------------------------------------------------------------------------
def _free_subnet() -> int:
    """A 198.18.S.0/24 no interface of this machine uses yet."""
    used = _run("ip", "-o", "-4", "addr", "show").stdout
    for subnet in range(os.getpid() % 200 + 1, 255):
        if f" {SUBNET_BASE}.{subnet}." not in used:
            return subnet
    raise TestbedUnavailable(f"every {SUBNET_BASE}.x.0/24 subnet is in use")


def _free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except OSError:
        return False


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _wait(ready, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout_s:g}s; the end of {log}:\n{_read(log)[-3000:]}")
        time.sleep(0.2)


def _netns_pids(netns: str) -> list[int]:
    proc = _run("ip", "netns", "pids", netns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _kill_trees(pids: list[Optional[int]], grace_s: float = 3.0) -> None:
    """SIGTERM the process groups these daemons lead (start_new_session) and the processes themselves,
    wait up to `grace_s` for all of them together, then SIGKILL what is left."""
    pids = [p for p in pids if p]

    def signal_all(sig) -> None:
        for pid in pids:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def alive() -> bool:
        for pid in pids:
            try:
                os.kill(pid, 0)
                if Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0:
                    return True
            except (ProcessLookupError, FileNotFoundError):
                continue
        return False

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_all(signal.SIGKILL)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.testbed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", default=os.path.join(tempfile.gettempdir(), "sl-testbed"),
                        help="the testbed's folder (state file, logs, host dirs)")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up")
    up.add_argument("--hosts", type=int, default=2)
    submit = sub.add_parser("submit", help="spark-submit ARGS (after --) on the testbed")
    submit.add_argument("args", nargs=argparse.REMAINDER)
    shape = sub.add_parser("shape")
    shape.add_argument("--rate", help="e.g. 1gbit, 200mbit; leave out to remove the limit")
    for name in ("cut", "heal", "power-off"):
        sub.add_parser(name).add_argument("host", type=int)
    sub.add_parser("counters")
    sub.add_parser("down")
    args = parser.parse_args(argv)
    if args.command == "up":
        bed = Testbed.create(args.hosts, root=args.state)
        try:
            bed.up()
        except BaseException:
            bed.down()
            raise
        print(f"testbed up: {bed.master_url}, {len(bed.hosts)} hosts ({', '.join(h.address for h in bed.hosts)}), "
              f"S3 {bed.s3_endpoint} bucket {bed.bucket}; state {bed.root}")
        return 0
    bed = Testbed.load(args.state)
    if args.command == "submit":
        rest = args.args[1:] if args.args[:1] == ["--"] else args.args
        return subprocess.run(bed.submit_command(*rest), env=bed.submit_env()).returncode
    if args.command == "shape":
        bed.shape(args.rate)
    elif args.command == "cut":
        bed.cut(args.host)
    elif args.command == "heal":
        bed.heal(args.host)
    elif args.command == "power-off":
        print(f"killed {bed.power_off(args.host)}")
    elif args.command == "counters":
        print(json.dumps(bed.counters(), indent=1))
    elif args.command == "down":
        bed.down()
        print("testbed down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
