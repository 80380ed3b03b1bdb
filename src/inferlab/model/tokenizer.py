"""Tokenizer: a `tokenizers` pipeline (byte-level or SentencePiece BPE) plus what generation needs (BOS/EOS ids, chat template)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from inferlab.model.gguf_vocab import gguf_backend


@dataclass
class Tokenizer:
    backend: HFTokenizer
    bos_id: int | None
    eos_ids: set[int]
    add_bos: bool = False
    chat_template: str | None = None
    special_ids: set[int] = field(default_factory=set)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The template's text for `messages`; `tools` (OpenAI's function definitions) are the template's to
        render, as Hugging Face templates take them (a template that does not read them leaves them out)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template: pass raw text (chat=false)")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_template_error
        bos = self.token_text(self.bos_id) if self.bos_id is not None else ""
        eos = self.token_text(min(self.eos_ids)) if self.eos_ids else ""
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, tools=tools
        )

    def save_hf_dir(self, path: Path, model_max_length: int) -> Path:
        """Write this tokenizer as a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json),
        so tools that tokenize on the client side (lm-eval's `tokenizer_backend=huggingface`) use exactly
        these ids, offline; from a GGUF this is the only form the tokenizer has on disk."""
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        names = {"bos_token": self.bos_id, "eos_token": min(self.eos_ids) if self.eos_ids else None}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "add_bos_token": self.add_bos,
            "clean_up_tokenization_spaces": False,
            **{name: self.token_text(i) for name, i in names.items() if i is not None},
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        return path

    @classmethod
    def from_gguf_fields(cls, meta: dict[str, Any]) -> Tokenizer:
        """The file's vocabulary (model/gguf_vocab.py), special ids and chat template."""
        backend, special = gguf_backend(meta)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eot = meta.get("tokenizer.ggml.eot_token_id")
        return cls(
            backend=backend,
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_ids={int(i) for i in (eos, eot) if i is not None},
            # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")),
            chat_template=meta.get("tokenizer.chat_template"),
            special_ids=set(special),
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """tokenizer.json plus tokenizer_config.json / generation_config.json for ids and template."""
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        tok_cfg = _read_json(path / "tokenizer_config.json")
        gen_cfg = _read_json(path / "generation_config.json")

        def token_id(entry: Any) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return backend.token_to_id(text) if text else None

        eos = gen_cfg.get("eos_token_id", token_id(tok_cfg.get("eos_token")))
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        bos_id = gen_cfg.get("bos_token_id", token_id(tok_cfg.get("bos_token")))
        template = tok_cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        return cls(
            backend=backend,
            bos_id=bos_id,
            eos_ids=eos_ids,
            add_bos=bool(tok_cfg.get("add_bos_token", False)),
            chat_template=template,
            special_ids=special,
        )


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without re-decoding everything each step.

    A delta is held back while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids before this are context only
        self.read_offset = 0  # ids before this have been emitted as text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
