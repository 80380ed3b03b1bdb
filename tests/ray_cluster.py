"""A Ray cluster on this machine for the tests: a head and worker nodes, each a `ray start` of its own, all on a
loopback address, in a temp dir of their own (its processes are found by it, and only they are stopped).

Ray resolves 127.0.0.1 to the machine's outward address, so the nodes take 127.0.0.2 (loopback all the same). Each
node offers `cpus` logical CPUs whatever the cores, usage stats stay off, token auth is off (loopback only, for the
test's life), and so is the memory monitor, which would kill a replica when other work fills the shared machine.
A node that fails to start is started again (`ray start` gives a raylet 30 s to register, which a loaded 2-core
machine can miss); a late one joining after all only adds a node.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from inferlab.bench.targets import free_port

NODE_IP = "127.0.0.2"
RAY = Path(sys.executable).with_name("ray")
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_memory_monitor_refresh_ms": "0"}


@contextmanager
def local_ray_cluster(workers: int = 2, cpus: int = 1) -> Iterator[str]:
    """Start the cluster; yield its address (host:port of the head); stop its processes."""
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, **RAY_ENV}
    address = f"{NODE_IP}:{free_port(NODE_IP)}"
    common = [f"--node-ip-address={NODE_IP}", f"--num-cpus={cpus}", f"--temp-dir={temp}", "--disable-usage-stats"]
    try:
        head = [str(RAY), "start", "--head", f"--port={address.split(':')[1]}", "--include-dashboard=false"]
        start_node(head + common, env, lambda: stop_processes_under(temp))  # a head again, from nothing
        for _ in range(workers):
            start_node([str(RAY), "start", f"--address={address}", *common], env, lambda: None)
        yield address
    finally:
        stop_processes_under(temp)
        shutil.rmtree(temp, ignore_errors=True)


def start_node(argv: list[str], env: dict[str, str], before_retry: Callable[[], None], tries: int = 3) -> None:
    for _ in range(tries):
        started = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        if started.returncode == 0:
            return
        before_retry()
    raise AssertionError(f"{' '.join(argv[1:3])} failed {tries} times: {started.stderr[-2000:]}")


def stop_processes_under(temp: str) -> None:
    """SIGTERM, then SIGKILL, to every process whose command line names `temp` (this cluster's own: its GCS, raylets
    and agents), and to their children (the workers, whose titles Ray rewrites)."""
    roots = [p for p in psutil.process_iter(["cmdline"]) if any(temp in arg for arg in p.info["cmdline"] or ())]
    mine = {p.pid: p for p in roots}
    for p in roots:
        try:
            mine.update((c.pid, c) for c in p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    alive = list(mine.values())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(alive, timeout=10)
        if not alive:
            return
