"""inferlab-serve-replicas replicas.num=2 [replicas.address=HOST:PORT] model=...: engine replicas on Ray Serve.

Connects to the Ray cluster at replicas.address (or starts a Ray instance of its own), runs the application of
replicas/ there with Ray Serve's HTTP proxy on server.host:server.port, and keeps it until SIGINT or SIGTERM,
when it deletes the application again. The cluster's every node needs this package installed (the replicas import
it), with the `replicas` extra: pip install -e '.[replicas]'.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from omegaconf import DictConfig

from inferlab.cli import hydra_app
from inferlab.errors import InvalidRequestError
from inferlab.server import ServerSettings
from inferlab.server.logs import configure_logging

log = logging.getLogger("inferlab.server")

# A Ray instance of its own talks to itself on loopback only: Ray takes 127.0.0.1 to mean the machine's outward
# address, any other loopback address as given
LOCAL_NODE_IP = "127.0.0.2"


def run(cfg: DictConfig, stop: threading.Event | None = None) -> None:
    """Serve until `stop` is set (by SIGINT or SIGTERM unless given)."""
    settings = ServerSettings.from_config(cfg.server)
    configure_logging(settings.log_level, settings.log_format)
    try:
        import ray
        from ray import serve

        from inferlab.replicas.deployments import build_app
    except ImportError as e:
        raise InvalidRequestError(f"Ray Serve is not installed ({e}): pip install -e '.[replicas]'") from None
    r = cfg.replicas
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine unless asked
    if r.address is None:
        # "local": a new instance, never one already running here
        ray.init(address="local", num_cpus=r.local_cpus, include_dashboard=False, _node_ip_address=LOCAL_NODE_IP)
    else:
        ray.init(address=str(r.address))
    if stop is None:
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port}, proxy_location="HeadOnly")
        serve.run(build_app(cfg), name=str(r.app_name), route_prefix="/", blocking=False)
        log.info(
            "%d replicas of %s (routing=%s) serving at http://%s:%d",
            r.num, cfg.model.name, r.routing, settings.host, settings.port,
        )  # fmt: skip
        while not stop.wait(1.0):
            pass
    finally:
        log.info("deleting the application %s", r.app_name)
        serve.delete(str(r.app_name))
        if not serve.status().applications:
            serve.shutdown()
        ray.shutdown()


@hydra_app("serve_replicas")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
