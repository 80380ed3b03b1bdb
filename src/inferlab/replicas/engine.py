"""ReplicatedEngine: the engine as the server's routes use it, each generation running on an engine replica.

The checks a request gets before any tensor work (sampling defaults, tokenizing, the context limit) run in the
ingress, with the engine's own code on the tokenizer and config a replica shipped at start (EngineFront); then the
tokenized request goes to a replica through a Ray Serve handle, whose router picks the replica by its prompt's
leading KV blocks (router.py), and the replica's engine events stream back. A replica that dies under a request
ends it with the engine's documented error (engine_failed: 503 before its first token, an SSE error event after);
Ray Serve starts another in its place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle

from inferlab.engine.engine import EngineConfig, GenerationRequest, InferenceEngine
from inferlab.engine.grammar import GrammarCompiler
from inferlab.engine.request import StreamEvent
from inferlab.errors import EngineFailedError
from inferlab.model.config import ModelConfig
from inferlab.model.tokenizer import Tokenizer


@dataclass
class ModelCard:
    """What the routes read of the loaded model (its weights stay on the replicas)."""

    config: ModelConfig
    source: str


@dataclass
class EngineFront:
    """What a replica ships to the ingress once: everything a request needs before it reaches an engine."""

    tokenizer: Tokenizer
    config: EngineConfig
    loaded: ModelCard


class ReplicatedEngine:
    """The part of InferenceEngine that server/ calls (create_app's routes and the Dispatcher), over replicas."""

    # the engine's own checks, which read only the tokenizer, the engine config, the model config and the grammars
    sampling_params = InferenceEngine.sampling_params
    encode_prompt = InferenceEngine.encode_prompt
    check_prompt = InferenceEngine.check_prompt
    check_constraint = InferenceEngine.check_constraint

    def __init__(self, replicas: DeploymentHandle, front: EngineFront, answer_timeout_s: float) -> None:
        self.replicas, self.answer_timeout_s = replicas, answer_timeout_s
        self.tokenizer, self.config, self.loaded = front.tokenizer, front.config, front.loaded
        # a constraint is checked here; its matcher runs on the replica
        self.grammars = GrammarCompiler(front.tokenizer, front.loaded.config.vocab_size)

    async def submit(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """The request's events from the replica the router picks; closing early cancels it there (its KV freed)."""
        stream = self.replicas.options(stream=True).generate.remote(request)
        finished = False
        try:
            async for event in stream:
                yield event
            finished = True
        except (RayActorError, RayTaskError) as e:
            raise replica_error(e) from None
        finally:
            if not finished:
                stream.cancel()

    def health(self) -> dict[str, str]:
        """A replica's health, with its name (an engine that stopped raises its EngineFailedError here)."""
        return self.ask("health")

    def stats(self) -> dict[str, Any]:
        """A replica's counters, with its name."""
        return self.ask("stats")

    def ask(self, method: str) -> Any:
        """Call `method` on a replica the router picks; from a worker thread (the routes that ask are sync)."""
        try:
            return getattr(self.replicas, method).remote().result(timeout_s=self.answer_timeout_s)
        except TimeoutError:
            raise EngineFailedError(f"no engine replica answered within {self.answer_timeout_s:g} s") from None
        except (RayActorError, RayTaskError) as e:
            raise replica_error(e) from None


def replica_error(e: RayActorError | RayTaskError) -> Exception:
    """What a failed replica call becomes: the engine's own error where the engine raised one (its message, not
    Ray's traceback), else engine_failed naming what happened to the replica."""
    if isinstance(e, RayTaskError) and isinstance(e.cause, Exception) and not isinstance(e.cause, RayActorError):
        return e.cause
    return EngineFailedError(
        f"the engine replica serving this request stopped ({type(e).__name__}); it is being replaced: send the "
        "request again"
    )
