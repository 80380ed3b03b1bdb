"""inferlab-serve model=smollm2-135m precision=int8 server.port=8000: the streaming HTTP server."""

from __future__ import annotations

import logging
import sys
import time

import uvicorn
from fastapi import FastAPI
from omegaconf import DictConfig

from inferlab.api import engine_from_config
from inferlab.cli import hydra_app
from inferlab.engine.engine import InferenceEngine
from inferlab.server import ServerSettings, create_app
from inferlab.server.guards import Guards
from inferlab.server.logs import configure_logging

log = logging.getLogger("inferlab.server")


class GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT: refuse new work at once (503 on kept-alive connections too), let running
    streams finish for `server.shutdown_grace_s`, then cancel them, which frees their KV.

    Supervises the engine: once its loop has stopped (`engine.failure`; every request it held was told),
    /health answers 503 with the reason for `server.shutdown_grace_s`, so whatever watches it sees why;
    then the server drains like on SIGTERM and the process exits 1, for a process manager to restart it.
    """

    def __init__(self, config: uvicorn.Config, guards: Guards, engine: InferenceEngine) -> None:
        super().__init__(config)
        self.guards, self.engine = guards, engine
        self.engine_failed_at: float | None = None

    async def on_tick(self, counter: int) -> bool:
        if self.engine.failure is not None:
            now = time.monotonic()
            if self.engine_failed_at is None:
                self.engine_failed_at = now
                log.critical(
                    "%s: the server exits in %.0f s", self.engine.failure, self.config.timeout_graceful_shutdown
                )
            if now - self.engine_failed_at >= self.config.timeout_graceful_shutdown:
                return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        self.guards.draining = True
        log.info(
            "draining: new requests are refused, running streams get %.0f s to finish",
            self.config.timeout_graceful_shutdown,
        )
        await super().shutdown(sockets)


def serve(app: FastAPI, settings: ServerSettings, engine: InferenceEngine) -> int:
    """Run until shut down; the exit status: 1 when the engine stopped, else 0."""
    # log_config=None: uvicorn's own lines go through the root handler, in server.log_format too
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )
    GracefulServer(config, app.state.guards, engine).run()
    return 1 if engine.failure else 0


def run(cfg: DictConfig, engine: InferenceEngine | None = None) -> int:
    """Serve `cfg` (an engine built from it unless given); the exit status."""
    settings = ServerSettings.from_config(cfg.server)
    configure_logging(settings.log_level, settings.log_format)
    engine = engine or engine_from_config(cfg)
    log.info("model %s (%s) on %s: %s", cfg.model.name, engine.loaded.source, engine.config.device, engine.describe())
    return serve(create_app(engine, settings, str(cfg.model.name)), settings, engine)


@hydra_app("serve")
def main(cfg: DictConfig) -> None:
    if status := run(cfg):
        sys.exit(status)


if __name__ == "__main__":
    main()
