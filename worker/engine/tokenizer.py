"""Tokenizers: a file-free byte tokenizer for presets and the fake engine, and a thin wrapper over Hugging Face
tokenizers. Both satisfy `api.TokenizerProtocol`: `encode(text)`, `encode_chat(messages)`, `decode(ids)`,
`special_token_id(text)`, `token_bytes(id)`, `eos_token_ids`, `vocab_size`. Imports no torch, so the fake engine can use the byte tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .api import ChatOptions


class NoChatTemplate(ValueError):
    """A chat was given to a tokenizer that has no chat template (`cbq worker --chat-template FILE` gives one)."""


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; then BOS, EOS and PAD. Ids past those decode to nothing.

    Needs no files, so tests and benchmarks never download anything. `add_bos=False` (the fake engine, which
    echoes the prompt) encodes text to its bytes alone.
    """

    NUM_BYTES = 256

    def __init__(self, add_bos: bool = True, extra_eos_ids: tuple[int, ...] = ()):
        self.add_bos = add_bos
        self.bos_token_id = self.NUM_BYTES
        self.eos_token_id = self.NUM_BYTES + 1
        self.pad_token_id = self.NUM_BYTES + 2
        self.vocab_size = self.NUM_BYTES + 3
        self.eos_token_ids = frozenset({self.eos_token_id, *extra_eos_ids})  # and the checkpoint's, if any

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if self.add_bos and add_special_tokens else ids

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions = ChatOptions(),
    ) -> list[int]:
        # A fixed, documented template: "<|role|>\ncontent\n" per message, then the assistant's turn. It has
        # no variables, so `template_kwargs` and `tools` change nothing. BOS is its own, as in a checkpoint's.
        turns = [f"<|{m['role']}|>\n{transcript_text(m)}\n" for m in messages]
        if options.continue_final_message:  # the last message stays open: the output continues its text
            turns[-1] = turns[-1].removesuffix("\n")
        elif options.add_generation_prompt:
            turns.append("<|assistant|>\n")
        return self.encode("".join(turns), add_special_tokens=True)

    def special_token_id(self, text: str) -> int | None:
        return None  # BOS, EOS and PAD have no text

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        """Bytes as text; BOS, EOS and PAD as their names unless `skip_special_tokens` (no spaces are put
        between them: they are not words)."""
        if skip_special_tokens:
            return bytes(i for i in ids if 0 <= i < self.NUM_BYTES).decode("utf-8", errors="replace")
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """A byte's id is that byte; a special token is its name (as in logprobs); other ids are empty."""
        if 0 <= token_id < self.NUM_BYTES:
            return bytes([token_id])
        specials = {self.bos_token_id: b"<s>", self.eos_token_id: b"</s>", self.pad_token_id: b"<pad>"}
        return specials.get(token_id, b"")


class HFTokenizer:
    """Wraps a `transformers` tokenizer loaded from a local path or hub name."""

    def __init__(self, tokenizer: Any, extra_eos_ids: tuple[int, ...] = ()):
        self._tok = tokenizer
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.eos_token_ids = frozenset(eos | set(extra_eos_ids))
        self.vocab_size = len(tokenizer)
        # The tokens `decode` drops (skip_special_tokens), by their text.
        self._special_ids = dict(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=True))
        self._special_ids.update(
            {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        )
        self._llg_tokenizer: Any = None  # llguidance's view of the vocabulary, built at the first token_bytes

    @property
    def backend(self) -> Any:
        """The wrapped `transformers` tokenizer (grammar.py builds llguidance's vocabulary from it)."""
        return self._tok

    @classmethod
    def from_pretrained(cls, name_or_path: str, extra_eos_ids: tuple[int, ...] = ()) -> HFTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False), extra_eos_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` (Jinja, as in a tokenizer_config.json) instead of the checkpoint's."""
        self._tok.chat_template = template

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions = ChatOptions(),
    ) -> list[int]:
        """The chat template's rendering, with `template_kwargs` as extra template variables (Qwen3's
        `enable_thinking`) and `tools` as the template's tool definitions, tokenized as vLLM does (the
        template writes its own BOS: no special tokens are added unless `options` asks). Without a template,
        `NoChatTemplate`: a chat turned into some other text would run silently wrong."""
        if not getattr(self._tok, "chat_template", None):
            raise NoChatTemplate(
                "the model's tokenizer has no chat template: start the worker with --chat-template FILE, "
                "or send completions prompts"
            )
        text = self._tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=options.add_generation_prompt and not options.continue_final_message,
            continue_final_message=options.continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
        return self.encode(text, add_special_tokens=options.add_special_tokens)

    def special_token_id(self, text: str) -> int | None:
        return self._special_ids.get(text)

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        return self._tok.decode(
            ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
        )

    def token_bytes(self, token_id: int) -> bytes:
        """The token's exact bytes (byte-level BPE pieces and sentencepiece byte tokens undone); a special
        token is its name. llguidance already reads every vocabulary format this way: it is a core dependency."""
        if self._llg_tokenizer is None:
            import llguidance.hf

            self._llg_tokenizer = llguidance.hf.from_tokenizer(self._tok)
        if not 0 <= token_id < self._llg_tokenizer.vocab_size:
            return b""
        return self._llg_tokenizer.decode_bytes([token_id])


def transcript_text(message: dict[str, Any]) -> str:
    """A message's text where no chat template renders it: its content (an image part as "<image>"), else the
    calls it made, as JSON."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part["text"] if part["type"] == "text" else "<image>" for part in content)
    if content is not None:
        return content
    return json.dumps([call["function"] for call in message.get("tool_calls", [])], ensure_ascii=False)
