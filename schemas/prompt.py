"""How a request's prompt becomes tokens: vLLM's prompt fields (`add_special_tokens`, `add_generation_prompt`,
`continue_final_message`) and the forms a completions `prompt` may take (text, token ids, a list of prompts).

Owns `PromptOptions`, what the stored request carries of them (None: the default of the request's kind).
The engine side of it is `worker.engine.api.ChatOptions`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from schemas.limits import MAX_PROMPT_TOKEN_IDS, MAX_PROMPTS, MAX_TOKEN_ID
from schemas.strict import StrictModel


class PromptSpelling(StrictModel):
    """The prompt field every request shape may give (a mixin of lines and bodies)."""

    add_special_tokens: bool | None = Field(
        None,
        description="Add the tokenizer's special tokens (BOS) to the prompt (default: true for a prompt, false "
        "for a chat, whose template writes its own); false for a prompt that was rendered with them already.",
    )

    def prompt_options(self) -> PromptOptions | None:
        """What the stored request keeps of these fields; None when the line gives none."""
        given = {name: getattr(self, name, None) for name in PromptOptions.model_fields}
        return PromptOptions(**given) if any(value is not None for value in given.values()) else None


class ChatSpelling(PromptSpelling):
    """The fields chats add (a mixin of chat lines and chat bodies, which have `messages`)."""

    add_generation_prompt: bool | None = Field(
        None, description="Chats: open the assistant's turn after the messages (default: true)."
    )
    continue_final_message: bool | None = Field(
        None,
        description="Chats: continue the last message, an assistant's prefill, instead of closing it (default: "
        "false).",
    )

    @model_validator(mode="after")
    def _continue_an_assistant_message(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("give add_generation_prompt or continue_final_message, not both")
        messages = getattr(self, "messages", None)
        if self.continue_final_message and messages and messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self


class PromptOptions(ChatSpelling):
    """vLLM's fields on how the prompt is tokenized, as the stored request keeps them; None means the default
    of the request's kind."""


def _token_ids(value: list[Any]) -> list[int]:
    if len(value) > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"at most {MAX_PROMPT_TOKEN_IDS} token ids, got {len(value)}")
    if not all(0 <= v <= MAX_TOKEN_ID for v in value):
        raise ValueError(f"token ids are 0 to {MAX_TOKEN_ID}")
    return value


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(v) is int for v in value)


def completion_prompts(value: Any) -> list[str | list[int]]:
    """A completions body's `prompt` as OpenAI spells it (text, token ids, a list of texts, a list of token id
    lists), as the list of its prompts: each one is a choice group of the request's output."""
    if isinstance(value, str) or _is_token_ids(value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("a prompt is a string, token ids, or a non-empty list of either")
    if len(value) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(value)}")
    prompts: list[str | list[int]] = []
    for item in value:
        if isinstance(item, str):
            prompts.append(item)
        elif _is_token_ids(item):
            prompts.append(_token_ids(item))
        else:
            raise ValueError("each prompt of a list is a string or a non-empty list of token ids")
    return prompts


class CompletionPrompt(StrictModel):
    """Mixin: a completions body's `prompt`, normalized to the list of its prompts (usually one)."""

    prompt: list[str | list[int]]

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        return completion_prompts(value)
