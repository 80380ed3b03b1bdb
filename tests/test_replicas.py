"""Engine replicas on Ray Serve through `inferlab-serve-replicas`, on a Ray cluster of this machine (a head and two
workers on loopback, tests/ray_cluster.py): 2 replicas of the tiny random model behind one endpoint, driven by the
`openai` client. References: the prefix-cache hits each replica's /metrics counts against what prefix-affine
routing must give (every follow-up prompt on the replica that computed its prefix); after a replica is killed
mid-load, every request either completed or ended with the documented engine_failed, Ray Serve put a new replica in
its place, and neither replica holds KV or a request."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray_cluster import RAY_ENV, local_ray_cluster

from inferlab.bench.targets import LaunchedServer, free_port

pytest.importorskip("ray.serve", reason="the replicas extra: pip install -e '.[replicas]'")
openai = pytest.importorskip("openai")

GROUPS, PREFIX_BLOCKS, BLOCK = 8, 4, 16  # prompts sharing a prefix of 4 full KV blocks, 8 such prefixes
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def cluster():
    with local_ray_cluster(workers=2) as address:
        yield address


def prompts(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Each group's shared prefix, and 4 suffixes of 8 tokens per group (every prompt distinct)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(GROUPS)]
    suffixes = [[rng.randrange(1000, 40000) for _ in range(8)] for _ in range(4)]
    return prefixes, suffixes


async def stream(client, prompt: list[int], max_tokens: int, first_token: asyncio.Event | None = None) -> str:
    """One streamed completion: 'ok' once it ended with its tokens, else the error code it ended with."""
    tokens = 0
    try:
        chunks = await client.completions.create(
            model="tiny-random", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in chunks:
            tokens += bool(chunk.choices and chunk.choices[0].text is not None)
            if first_token is not None:
                first_token.set()
    except openai.APIError as e:
        return str(getattr(e, "code", None) or (e.body or {}).get("error", {}).get("code"))
    return "ok" if tokens >= max_tokens else f"short ({tokens} tokens)"


def replica_metrics(url: str, want: int = 2, timeout_s: float = 180) -> dict[str, dict[str, float]]:
    """Scrape /metrics through the endpoint until `want` distinct replicas have answered: each one's gauges."""
    seen: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < deadline:
        r = httpx.get(f"{url}/metrics", timeout=30)
        if r.status_code == 200:
            values = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
            seen[r.headers["x-inferlab-replica"]] = values
        else:
            time.sleep(0.5)
    assert len(seen) >= want, f"only replicas {sorted(seen)} answered /metrics within {timeout_s:.0f} s"
    return seen


def replica_pids(address: str) -> dict[str, int]:
    """Each engine replica's name (as /metrics labels it) -> its process id, from the cluster's named actors."""
    script = (
        "import ray, sys\n"
        "ray.init(address=sys.argv[1], logging_level='ERROR')\n"
        "for a in ray.util.list_named_actors(all_namespaces=True):\n"
        "    if '#engine#' in a['name']:\n"
        "        actor = ray.get_actor(a['name'], namespace=a['namespace'])\n"
        "        print(a['name'].rsplit('#', 1)[1], ray.get(actor.__ray_call__.remote(lambda self: __import__('os').getpid())))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, address],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **RAY_ENV},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return {name: int(pid) for name, pid in (line.split() for line in out.stdout.splitlines() if line.strip())}


@pytest.mark.slow
def test_two_replicas_route_by_prefix_and_survive_a_killed_replica(cluster, tmp_path: Path):
    port = free_port("127.0.0.1")
    argv = [
        str(BIN / "inferlab-serve-replicas"),
        "model=tiny-random",
        "replicas.num=2",
        f"replicas.address={cluster}",
        "replicas.health_check_period_s=1",
        "server.rate_limit=100000/minute",
        "server.host=127.0.0.1",
        f"server.port={port}",
    ]
    prefixes, suffixes = prompts()
    with LaunchedServer(argv, "127.0.0.1", port, 600, tmp_path / "replicas.log", RAY_ENV) as server:
        url = server.url

        async def load(batch: list[list[int]], max_tokens: int, first_token=None) -> list[str]:
            """Every prompt of `batch` at once, each streamed; no retries, so a failure shows as it came."""
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120) as client:
                return await asyncio.gather(*(stream(client, p, max_tokens, first_token) for p in batch))

        # 1. one prompt per prefix (the router has seen none: power of two choices), 2. one more per prefix
        assert asyncio.run(load([p + suffixes[0] for p in prefixes], 8)) == ["ok"] * GROUPS
        before = replica_metrics(url)
        assert asyncio.run(load([p + suffixes[1] for p in prefixes], 8)) == ["ok"] * GROUPS
        after = replica_metrics(url)
        assert set(after) == set(before)
        hits = {r: after[r]["inferlab_prefix_cache_hits"] - before[r]["inferlab_prefix_cache_hits"] for r in after}
        # each follow-up went where its prefix was computed: all of its 4 leading blocks were cached there
        assert sum(hits.values()) == GROUPS * PREFIX_BLOCKS, hits

        # 3. two more per prefix, long streams; the replica holding most prefixes is killed at the first token
        victim = max(hits, key=hits.get)
        pid = replica_pids(cluster)[victim]

        async def load_and_kill() -> list[str]:
            first_token = asyncio.Event()
            task = asyncio.create_task(load([p + s for s in suffixes[2:] for p in prefixes], 256, first_token))
            await first_token.wait()
            os.kill(pid, signal.SIGKILL)
            return await task

        ends = asyncio.run(load_and_kill())
        assert set(ends) <= {"ok", "engine_failed"}, ends
        assert "engine_failed" in ends, "the kill came after every request had ended"

        # the replica is replaced, and neither replica holds KV or a request
        deadline = time.monotonic() + 300
        while victim in (now := replica_metrics(url)) or len(now) < 2:
            assert time.monotonic() < deadline, f"replicas {sorted(now)}: {victim} was not replaced"
        for name, gauges in now.items():
            assert gauges["inferlab_kv_blocks_used"] == 0 and gauges["inferlab_kv_cache_usage_perc"] == 0, name
            assert gauges["inferlab_requests_running"] == 0 and gauges["inferlab_requests_waiting"] == 0, name
        assert asyncio.run(load([prefixes[0] + suffixes[0]], 8)) == ["ok"]  # and serving goes on
