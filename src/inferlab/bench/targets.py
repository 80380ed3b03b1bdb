"""What a load study drives: the engine in this process, or a real `inferlab-serve` subprocess over HTTP."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from inferlab.api import engine_from_config
from inferlab.bench.loadgen import HTTPTarget, clock
from inferlab.bench.metrics import RequestRecord
from inferlab.bench.prompts import Prompt
from inferlab.engine.engine import GenerationRequest, InferenceEngine
from inferlab.engine.sampling import SamplingParams

ENGINE_GROUPS = ("model", "precision", "cache", "spec", "device")  # what the server must be launched with
ENGINE_KEYS = (*ENGINE_GROUPS, "seed", "max_new_tokens", "temperature", "top_p", "top_k", "chat")


@dataclass
class EngineTarget:
    """The in-process engine behind the same `send` interface the HTTP client offers."""

    engine: InferenceEngine
    params: SamplingParams

    async def send(self, prompt: Prompt, record: RequestRecord) -> None:
        async for event in self.engine.submit(GenerationRequest(prompt=prompt.token_ids, params=self.params)):
            if event.token_id is not None:
                record.chunk_times.append(clock())
            elif event.timings is not None:
                record.output_tokens = event.timings.completion_tokens

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


class ServedTarget(HTTPTarget):
    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.base_url}/v1/metrics", timeout=10).json()


@contextmanager
def open_target(
    cfg: DictConfig, choices: dict[str, str], task_overrides: list[str], log_dir: Path, output_tokens: int
) -> Iterator[EngineTarget | ServedTarget]:
    """The job's target; `choices` and `task_overrides` (Hydra's) say how to launch an identical server."""
    if cfg.target.kind == "engine":
        engine = engine_from_config(cfg)
        yield EngineTarget(engine, engine.sampling_params(max_new_tokens=output_tokens))
        return
    overrides = [f"{g}={choices[g]}" for g in ENGINE_GROUPS if g in choices]
    overrides += [
        o
        for o in task_overrides
        if o.lstrip("+~").split("=")[0].split(".")[0] in ENGINE_KEYS + ("server",)
        and o.split("=")[0] not in ENGINE_GROUPS
    ]
    with ServerProcess(
        list(cfg.target.command),
        [*overrides, *cfg.target.overrides],
        cfg.target.host,
        float(cfg.target.startup_timeout_s),
        log_dir / "server.log",
    ) as url:
        target = ServedTarget(url, cfg.target.api, max_tokens=output_tokens, temperature=float(cfg.temperature))
        yield target


def open_job_target(cfg: DictConfig, output_tokens: int) -> AbstractContextManager[EngineTarget | ServedTarget]:
    """`open_target` for the running Hydra job: its choices and overrides, its output dir for the server log."""
    hydra = HydraConfig.get()
    return open_target(
        cfg, dict(hydra.runtime.choices), list(hydra.overrides.task), Path(hydra.runtime.output_dir), output_tokens
    )


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RunningServer:
    """A server already running at `url` (a cluster's endpoint): waited for until `health_path` answers 200, never
    paused or stopped here."""

    def __init__(self, url: str, startup_timeout_s: float, health_path: str = "/health") -> None:
        self.url, self.timeout, self.health_path = url, startup_timeout_s, health_path

    def __enter__(self) -> RunningServer:
        self.wait_healthy()
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def check_alive(self) -> None:
        """Raise if the server can no longer come up (a process that exited)."""

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(f"{self.url}{self.health_path}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(
            f"server did not answer {self.url}{self.health_path} within {self.timeout:.0f} s{self.where()}"
        )

    def where(self) -> str:
        return ""

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


class LaunchedServer(RunningServer):
    """Start `argv` (a server listening on `port`, with `env` added to this process's environment); wait
    until `health_path` answers 200; stop it on exit. `pausable`: whether pause() may stop its processes while
    another server is measured (not a Ray instance, whose own health checks would miss their deadlines)."""

    def __init__(
        self,
        argv: list[str],
        host: str,
        port: int,
        startup_timeout_s: float,
        log_path: Path,
        env: dict[str, str] | None = None,
        health_path: str = "/health",
        pausable: bool = True,
    ) -> None:
        super().__init__(f"http://{host}:{port}", startup_timeout_s, health_path)
        self.host, self.port, self.argv, self.env = host, port, argv, env or {}
        self.log_path, self.pausable = log_path, pausable
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LaunchedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **self.env}
            )
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"server exited with code {self.process.returncode}: {' | '.join(tail)}")

    def where(self) -> str:
        return f" (log: {self.log_path})"

    def pause(self) -> None:
        """Stop the server's processes where they stand (SIGSTOP), so an idle server takes no CPU time."""
        if self.pausable:
            os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.pausable:
            os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Signal the server's whole process group (its own session): servers such as vLLM run workers."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        os.killpg(self.process.pid, signal.SIGCONT)  # a paused server handles the signal once it runs
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class ServerProcess(LaunchedServer):
    """`inferlab-serve` (`command`) with Hydra `overrides`, on a free port of `host`; `with` gives its URL."""

    def __init__(
        self, command: list[str], overrides: list[str], host: str, startup_timeout_s: float, log_path: Path
    ) -> None:
        port = free_port(host)
        executable = shutil.which(
            command[0], path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        )
        argv = [executable or command[0], *command[1:], *overrides, f"server.host={host}", f"server.port={port}"]
        super().__init__(argv, host, port, startup_timeout_s, log_path)

    def __enter__(self) -> str:  # type: ignore[override]  # the URL, for `with ... as url`
        return super().__enter__().url
