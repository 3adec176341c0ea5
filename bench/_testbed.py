"""What the multi-host benches share (bench/network_bench.py, bench/hosts_modes_bench.py): one testbed for the
whole bench, one spark-submit application of the bench script itself (``--inside``) per host count, and its
tagged JSON lines collected as rows while they are printed.

Not a package: the benches run as scripts (their folder is on sys.path).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]


def run_on_testbed(script: str, hosts: list[int], *, tag: str, prefix: str,
                   inside_args: Callable[[object, str, int], list[str]], announce: Callable[[int], str],
                   show: Callable[[dict], str]) -> tuple[int, list[dict]]:
    """(exit code, rows): for each N in ``hosts``, ``script --inside <inside_args(bed, root, N)>`` submitted to N
    testbed hosts; every ``<tag> {json}`` line it prints becomes a row (and ``show(row)`` is printed). Exit
    code 2: no testbed here; 1: an application failed (its last lines are printed)."""
    from tests.cluster.testbed import Testbed, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"{Path(script).name} needs the multi-host testbed: {reason}", file=sys.stderr)
        return 2, []
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix=prefix) as root:
        with Testbed.create(max(hosts), root=root) as bed:
            for n in hosts:
                command = bed.submit_command(str(Path(script).resolve()), "--inside", *inside_args(bed, root, n),
                                             executors=n)
                env = {**bed.submit_env(), "PYTHONPATH": str(REPO)}
                print(f"N={n}: {announce(n)}", flush=True)
                proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                tail: list[str] = []
                for line in proc.stdout:
                    tail = (tail + [line])[-60:]
                    if line.startswith(f"{tag} "):
                        rows.append(json.loads(line[len(tag) + 1:]))
                        print(show(rows[-1]), flush=True)
                if proc.wait() != 0:
                    print("".join(tail), file=sys.stderr)
                    return 1, rows
    return 0, rows


def parse_or_run_inside(parser, inside: Callable[[object], None]):
    """The arguments of a multi-host bench, with the hidden ones its spark-submit application gets (``--inside
    --state --workdir --n``); inside that application, ``inside(args)`` runs and None is returned."""
    import argparse

    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside(args)
        return None
    return args
