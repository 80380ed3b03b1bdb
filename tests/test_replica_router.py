"""The replicas' prefix-affine router (replicas/router.py) on its own, with stand-in replicas: its block keys are the
engine prefix cache's own; a prompt goes to the replica that was sent its longest run of leading blocks, a prompt no
replica was sent (or whose replica is too busy, or dead) gets power of two choices. Milliseconds, no Ray cluster."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from conftest import tiny_engine

pytest.importorskip("ray.serve", reason="the replicas extra: pip install -e '.[replicas]'")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID  # noqa: E402
from ray.serve._private.request_router.common import RequestRoutingContext  # noqa: E402
from ray.serve.request_router import ReplicaID  # noqa: E402

from inferlab.engine.engine import GenerationRequest  # noqa: E402
from inferlab.engine.sampling import SamplingParams  # noqa: E402
from inferlab.replicas.router import PrefixAffinityRouter, block_keys  # noqa: E402

DEPLOYMENT = DeploymentID(name="engine", app_name="inferlab")


@dataclass(eq=False)
class Replica:  # what the router reads of a RunningReplica
    replica_id: ReplicaID


@dataclass
class Pending:  # what the router reads of a PendingRequest
    args: list
    routing_context: RequestRoutingContext


def pending(prompt: list[int]) -> Pending:
    return Pending([GenerationRequest(prompt, SamplingParams(max_new_tokens=4))], RequestRoutingContext())


@pytest.fixture
def router():
    router = PrefixAffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=4, imbalance=3)
    return router


def replicas(n: int) -> list[Replica]:
    return [Replica(ReplicaID(f"r{i}", DEPLOYMENT)) for i in range(n)]


def choose(router, candidates, prompt):
    return asyncio.run(router.choose_replicas(candidates, pending(prompt)))


def test_block_keys_are_the_prefix_caches_keys(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, cache_mode="paged", prefix_cache=True)
    prompt = list(range(40, 90))  # 3 full blocks of 16 and 2 tokens
    engine.generate(prompt, max_new_tokens=1)
    cached = {key for key, _ in engine.blocks.prefix.entries.values()}
    assert len(block_keys(prompt, 16)) == 3 and set(block_keys(prompt, 16)) == cached


def test_a_prompt_goes_where_its_leading_blocks_went(router):
    a, b, c = candidates = replicas(3)
    seen, other = [1, 2, 3, 4, 5, 6, 7, 8, 9], [50, 51, 52, 53, 54]
    (first,) = choose(router, candidates, seen)  # nothing seen yet: two at random, the less busy is taken
    assert len(first) == 2
    router.on_request_routed(pending(seen), b.replica_id, None)
    router.on_request_routed(pending(other), c.replica_id, None)
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 100, 101], [1, 2, 3, 4, 99, 98, 97, 96], seen):
        ranks = choose(router, candidates, prompt)
        assert ranks[0] == [b] and b not in ranks[1] and len(ranks[1]) >= 1  # then two at random if b is full
    assert choose(router, candidates, [50, 51, 52, 53, 0])[0] == [c]
    assert len(choose(router, candidates, [9, 9, 9, 9, 1])[0]) == 2  # a first block no replica was sent
    assert len(choose(router, candidates, [1, 2, 3])[0]) == 2  # no full block: nothing to be affine to


def test_a_busy_or_dead_replica_gives_way_to_power_of_two_choices(router):
    a, b = candidates = replicas(2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    router.on_request_routed(pending(prompt), a.replica_id, None)
    router.replica_queue_len_cache.update(a.replica_id, 5)
    router.replica_queue_len_cache.update(b.replica_id, 3)
    assert choose(router, candidates, prompt)[0] == [a]  # 2 more in hand than b: under the imbalance of 3
    router.replica_queue_len_cache.update(b.replica_id, 2)
    assert len(choose(router, candidates, prompt)[0]) == 2  # 3 more: the least busy of two instead
    router.replica_queue_len_cache.update(a.replica_id, 0)
    router.on_replica_actor_died(a.replica_id)
    assert not router.owners and choose(router, [b], prompt) == [[b]]
