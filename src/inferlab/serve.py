"""inferlab-serve model=smollm2-135m precision=int8 server.port=8000: the streaming HTTP server."""

from __future__ import annotations

import logging

import uvicorn
from fastapi import FastAPI
from omegaconf import DictConfig

from inferlab.api import engine_from_config
from inferlab.cli import hydra_app
from inferlab.server import ServerSettings, create_app
from inferlab.server.guards import Guards
from inferlab.server.logs import configure_logging

log = logging.getLogger("inferlab.server")


class GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT: refuse new work at once (503 on kept-alive connections too), let running
    streams finish for `server.shutdown_grace_s`, then cancel them, which frees their KV."""

    def __init__(self, config: uvicorn.Config, guards: Guards) -> None:
        super().__init__(config)
        self.guards = guards

    async def shutdown(self, sockets=None) -> None:
        self.guards.draining = True
        log.info(
            "draining: new requests are refused, running streams get %.0f s to finish",
            self.config.timeout_graceful_shutdown,
        )
        await super().shutdown(sockets)


def serve(app: FastAPI, settings: ServerSettings) -> None:
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
    GracefulServer(config, app.state.guards).run()


@hydra_app("serve")
def main(cfg: DictConfig) -> None:
    settings = ServerSettings.from_config(cfg.server)
    configure_logging(settings.log_level, settings.log_format)
    engine = engine_from_config(cfg)
    log.info("model %s (%s) on %s: %s", cfg.model.name, engine.loaded.source, engine.config.device, engine.describe())
    serve(create_app(engine, settings, str(cfg.model.name)), settings)


if __name__ == "__main__":
    main()
