"""The names modules imported from `schemas.request` before the schemas were split by subject, re-exported.

Nothing is defined here. The homes: `schemas.sampling` (the sampling fields, `OutputConstraint`),
`schemas.chat` (messages, template variables), `schemas.openai_body` (OpenAI Batch lines and bodies),
`schemas.lines` (cbq's lines, `parse_request_line`, `Request`), `schemas.limits` (every bound).
New code imports from those.
"""

from schemas.chat import ChatMessage, ChatTemplateKwargs, checked_chat_template_kwargs
from schemas.lines import ChatLine, ParsedRequest, PromptLine, Request, parse_request_line
from schemas.openai_body import (
    CHAT_COMPLETIONS_URL,
    COMPLETIONS_URL,
    ChatCompletionBody,
    CompletionBody,
    OpenAIBatchLine,
)
from schemas.sampling import OutputConstraint, Sampling

# Lines, batch flags and stored requests share one model now: `Sampling`, None meaning "not given".
SamplingOverrides = Sampling

__all__ = [
    "CHAT_COMPLETIONS_URL",
    "COMPLETIONS_URL",
    "ChatCompletionBody",
    "ChatLine",
    "ChatMessage",
    "ChatTemplateKwargs",
    "CompletionBody",
    "OpenAIBatchLine",
    "OutputConstraint",
    "ParsedRequest",
    "PromptLine",
    "Request",
    "Sampling",
    "SamplingOverrides",
    "checked_chat_template_kwargs",
    "parse_request_line",
]
