"""How a request's prompt becomes tokens: vLLM's prompt fields (`add_special_tokens`, `add_generation_prompt`,
`continue_final_message`) and the forms a completions `prompt` may take (text, token ids, a one-prompt list).

Owns `PromptOptions`, what the stored request carries of them (None: the default of the request's kind).
The engine side of it is `worker.engine.api.ChatOptions`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from schemas.limits import MAX_PROMPT_TOKEN_IDS, MAX_TOKEN_ID
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


def completion_prompt(value: Any) -> str | list[int]:
    """A completions body's `prompt` as OpenAI spells it: text, token ids, or a list holding one of them.
    A list of several prompts fails its request (cbq runs one prompt per line for now)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # generated files often wrap the single prompt
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if len(value) > MAX_PROMPT_TOKEN_IDS:
            raise ValueError(f"at most {MAX_PROMPT_TOKEN_IDS} token ids, got {len(value)}")
        if not all(0 <= v <= MAX_TOKEN_ID for v in value):
            raise ValueError(f"token ids are 0 to {MAX_TOKEN_ID}")
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise PydanticCustomError(
            "unsupported_parameter",
            "a list of {count} prompts is not supported yet: give one prompt per line",
            {"count": len(value)},
        )
    raise ValueError("a prompt is a string, a non-empty list of token ids, or a list holding one of them")


class CompletionPrompt(StrictModel):
    """Mixin: a completions body's `prompt`, normalized to text or token ids."""

    prompt: str | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        return completion_prompt(value)
