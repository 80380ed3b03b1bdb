"""Shared fixtures: tiny random-init models and a byte-level tokenizer built in milliseconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import uvicorn
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from torch import nn

from inferlab.engine.engine import EngineConfig, InferenceEngine
from inferlab.engine.sampling import SamplingParams
from inferlab.engine.scheduler import SchedulerConfig
from inferlab.engine.spec.build import build_speculation
from inferlab.kernels.build import active_isa, load_isa, use_isa
from inferlab.kernels.isa import ISAS, cpu_flags, supported_isas
from inferlab.kernels.select import select_kernels
from inferlab.model.config import ModelConfig
from inferlab.model.loader import LoadedModel
from inferlab.model.tokenizer import Tokenizer
from inferlab.model.transformer import Transformer
from inferlab.quant import quantize_model

EOS = "<|eos|>"


def byte_level_backend() -> HFTokenizer:
    """256 byte tokens, no merges, one special end-of-sequence token (id 256)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(EOS, special=True)])
    return backend


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared machine they lose a lot to them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=list(ISAS))
def isa(request) -> str:
    """Each instruction set the kernels are built for, made the one this process calls for the test; the
    ones this CPU lacks skip, saying which flags are missing."""
    name = request.param
    if name not in supported_isas():
        pytest.skip(f"{name}: this CPU lacks {', '.join(sorted(set(ISAS[name].cpu_flags) - cpu_flags()))}")
    if not load_isa(name):
        pytest.skip("no C++ toolchain here")
    before = active_isa()
    use_isa(name)
    yield name
    use_isa(before.name if before else "auto")


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    backend = byte_level_backend()
    eos = backend.token_to_id(EOS)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    return Tokenizer(backend=backend, bos_id=None, eos_ids={eos}, chat_template=template, special_ids={eos})


def tiny_config(**overrides) -> ModelConfig:
    values = dict(
        vocab_size=257,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=128,
        max_seq_len=256,
        rope_theta=10000.0,
        norm_eps=1e-5,
    )
    values.update(overrides)
    return ModelConfig(**values)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    with torch.no_grad():  # larger-than-default weights so logits are far from uniform
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.1)
    return model.eval()


def tiny_engine(
    tokenizer: Tokenizer,
    cache_mode: str = "contiguous",
    slots: int = 2,
    seed: int = 0,
    max_new_tokens: int = 16,
    dtype: torch.dtype = torch.float32,
    kernels: str | None = None,
    quant: str | None = None,
    spec: dict | None = None,
    kv_dtype: torch.dtype | None = None,
    dense_copy_mb: float = 0,
    device: torch.device = torch.device("cpu"),
    prefix_cache: bool = False,
    **overrides,
) -> InferenceEngine:
    """`kernels` given: the model's layers are swapped for that choice (kernels/select.py) first, as
    load_engine does, after quantizing them with `quant` (int4: groups of 32) and building the drafter of
    `spec` (a resolved conf/spec group; its draft model's layers are swapped too). The same seed gives the same
    weights on every `device`."""
    model = tiny_model(seed, **overrides).to(device=device, dtype=dtype)
    if quant:
        quantize_model(model, quant, 32 if quant == "int4" else None)
    speculation = build_speculation(spec, "tiny", model, dtype, device) if spec else None
    if kernels:
        drafts = speculation.drafter.models() if speculation else []
        select_kernels(nn.ModuleList([model, *drafts]), device, dtype, kernels, dense_copy_mb)
    loaded = LoadedModel(model, tokenizer, model.config, "tiny random-init")
    config = EngineConfig(
        device=device,
        dtype=dtype,
        cache_mode=cache_mode,
        max_seq_len=model.config.max_seq_len,
        slots=slots,
        defaults=SamplingParams(max_new_tokens=max_new_tokens),
        block_size=16,
        kv_blocks=0,
        prefix_cache=prefix_cache,
        scheduler=SchedulerConfig(max_running=16, max_waiting=64, max_batched_tokens=256),
        kernels=kernels or "fast",
        kv_dtype=kv_dtype,
    )
    return InferenceEngine(loaded, config, speculation)


@contextmanager
def running_server(app) -> Iterator[str]:
    """`app` served by uvicorn on a free loopback port in a thread (a real socket, for real clients and
    browsers, while the test keeps the engine for its references); yields the base URL."""
    from inferlab.bench.targets import free_port

    port = free_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.perf_counter() + 30
    while not server.started and time.perf_counter() < deadline:
        time.sleep(0.02)
    assert server.started, "the test server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
