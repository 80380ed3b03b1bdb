"""The Ray Serve application: `num` engine replicas (EngineReplica, one InferenceEngine each) behind the server's
FastAPI app (Ingress, create_app over a ReplicatedEngine), routed by prompt prefix (router.py) or by Ray Serve's
power of two choices.

Ray Serve checks each engine replica every `health_check_period_s`: one whose engine loop has stopped fails the
check (its requests were already told, engine_failed), and Ray Serve replaces it, as it does a replica whose
process died.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from omegaconf import DictConfig, OmegaConf
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from inferlab.api import engine_from_config
from inferlab.engine.engine import GenerationRequest
from inferlab.engine.request import StreamEvent
from inferlab.replicas.engine import EngineFront, ModelCard, ReplicatedEngine
from inferlab.replicas.router import PrefixAffinityRouter
from inferlab.server import ServerSettings, create_app
from inferlab.server.logs import configure_logging

ROUTERS = ("prefix", "pow2")


class EngineReplica:
    """One engine, built from the app's config in the replica's own process."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        server = cfg["server"]
        configure_logging(server["log_level"], server["log_format"])
        self.engine = engine_from_config(OmegaConf.create(cfg))
        self.name = serve.get_replica_context().replica_id.unique_id

    def front(self) -> EngineFront:
        loaded = self.engine.loaded
        return EngineFront(self.engine.tokenizer, self.engine.config, ModelCard(loaded.config, loaded.source))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        async for event in self.engine.submit(request):
            yield event

    def health(self) -> dict[str, str]:
        return {**self.engine.health(), "replica": self.name}

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "replica": self.name}

    def check_health(self) -> None:
        """Ray Serve's check: raises once the engine loop has stopped, and the replica is replaced."""
        self.engine.health()


@serve.ingress()
class Ingress:
    """The server's FastAPI app, every route as in inferlab-serve, over the engine replicas."""

    async def __init__(self, replicas: DeploymentHandle, cfg: dict[str, Any]) -> None:
        settings = ServerSettings.from_config(cfg["server"])
        configure_logging(settings.log_level, settings.log_format)
        front = await replicas.front.remote()
        self.asgi = create_app(ReplicatedEngine(replicas, front, settings.timeout_s), settings, cfg["model"]["name"])

    def __serve_build_asgi_app__(self):
        return self.asgi


def build_app(cfg: DictConfig) -> Application:
    """The application for `cfg` (conf/serve_replicas.yaml): its engine replicas bound under its ingress."""
    r = cfg.replicas
    if r.routing not in ROUTERS:
        raise ValueError(f"replicas.routing must be one of {', '.join(ROUTERS)}, got {r.routing!r}")
    router = (
        RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"block_size": int(cfg.cache.block_size), "imbalance": int(r.imbalance)},
        )
        if r.routing == "prefix"
        else RequestRouterConfig()
    )
    values = OmegaConf.to_container(cfg, resolve=True)
    engines = serve.deployment(
        name="engine",
        num_replicas=int(r.num),
        max_ongoing_requests=int(r.max_ongoing_requests),
        health_check_period_s=float(r.health_check_period_s),
        ray_actor_options={"num_cpus": float(r.num_cpus)},
        request_router_config=router,
    )(EngineReplica)
    ingress = serve.deployment(
        name="ingress",
        num_replicas=int(r.ingress_replicas),
        max_ongoing_requests=int(r.max_ongoing_requests) * int(r.num),
        ray_actor_options={"num_cpus": 0},
    )(Ingress)
    return ingress.bind(engines.bind(values), values)
