"""Prefix-affine routing for Ray Serve: a request goes to the replica whose prefix cache likely holds its prompt.

The router (one per process that holds a handle to the engine replicas: the ingress) keeps its own record of where
it sent each prompt's leading KV blocks, keyed by the same chained hash of block_size token ids the engine's prefix
cache uses (engine/kv/prefix_cache.py), so "likely holds" means "was sent a prompt with these full blocks". A
request goes to the replica that was sent its longest run of leading blocks, unless that replica already has
`imbalance` more requests in hand than the least busy one, or is full; otherwise, and for a prompt no replica has
seen, it takes Ray Serve's default: the less busy of two replicas drawn at random (power of two choices).
The record forgets the least recently routed blocks beyond `max_blocks`, and a dead replica's blocks at once.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from inferlab.engine.kv.prefix_cache import chain_hash


def block_keys(prompt_ids: list[int], block_size: int) -> list[int]:
    """The prefix-cache key of each full block of `prompt_ids`, first block first."""
    keys, parent = [], None
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, tuple(prompt_ids[start : start + block_size]))
        keys.append(parent)
    return keys


def prompt_ids_of(pending_request: PendingRequest | None) -> list[int]:
    """The prompt's token ids when the request is a generation (a GenerationRequest whose prompt the ingress has
    tokenized); [] for anything else (counters, health)."""
    for arg in pending_request.args if pending_request is not None else ():
        prompt = getattr(arg, "prompt", None)
        if isinstance(prompt, list):
            return prompt
    return []


class PrefixAffinityRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, block_size: int = 16, imbalance: int = 16, max_blocks: int = 1 << 16, **_: Any):
        self.block_size, self.imbalance, self.max_blocks = block_size, imbalance, max_blocks
        self.owners: OrderedDict[int, ReplicaID] = OrderedDict()  # block key -> the replica last sent it

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:  # every candidate is weighed each round: back off when none accepted
            pending_request.routing_context.should_backoff = True
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        owner = self.owner(block_keys(prompt_ids_of(pending_request), self.block_size), candidate_replicas)
        if owner is None:
            return [two]
        return [[owner], [r for r in two if r is not owner] or two]

    def owner(self, keys: list[int], candidates: list[RunningReplica]) -> RunningReplica | None:
        """The candidate sent the longest run of these leading blocks, if it is not `imbalance` requests busier
        than the least busy candidate (by the queue lengths the router last heard; unknown counts as idle)."""
        by_id = {r.replica_id: r for r in candidates}
        found = None
        for key in keys:
            replica = by_id.get(self.owners.get(key))  # type: ignore[arg-type]
            if replica is None:
                break
            found = replica
        if found is None:
            return None
        load = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidates}
        return found if load[found.replica_id] - min(load.values()) < self.imbalance else None

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        for key in block_keys(prompt_ids_of(pending_request), self.block_size):
            self.owners[key] = replica_id
            self.owners.move_to_end(key)
        while len(self.owners) > self.max_blocks:
            self.owners.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [k for k, owner in self.owners.items() if owner == replica_id]:
            del self.owners[key]
