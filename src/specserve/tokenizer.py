"""Tokenizer from `tokenizer.json` with the chat template of `tokenizer_config.json`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"{model_dir}: no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"{path}: cannot load tokenizer ({e})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = self.config.get("chat_template")
        jinja_path = model_dir / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        self.chat_template: str | None = template
        self.eos_token: str | None = _token_str(self.config.get("eos_token"))
        self.bos_token: str | None = _token_str(self.config.get("bos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
        """A step function for one stream of ids: the next ids in, the text they complete out (`tokenizers`'
        DecodeStream: "" while an incomplete UTF-8 sequence is pending). Raises ValueError where the
        decoder rewrites text it already gave out (not prefix-stable)."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)

        def step(ids: list[int]) -> str:
            try:  # one id as an int: a list costs ~0.7 µs more to convert
                return stream.step(self._tok, ids[0] if len(ids) == 1 else ids) or ""
            except Exception as e:  # tokenizers raises a bare Exception ("Invalid prefix encountered")
                raise ValueError(str(e)) from None

        return step

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what grammar libraries build their token tables from)."""
        return str(self._tok.to_str())

    def token_to_id(self, token: str) -> int | None:
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template; use a plain prompt")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            tmpl = env.from_string(self.chat_template)
            return tmpl.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from None


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _raise(msg: str) -> None:
    raise jinja2.TemplateError(msg)
