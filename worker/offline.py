"""The offline library API: `LLM(model).generate(...)` and `.chat(...)` in a notebook or a script, without Redis
or a worker. Owns the conversion of Python inputs into request lines and of the engine's results back into
result lines; it validates, resolves and converts through the same code as `cbq submit` and the queue worker
(`producer.store.validate_lines`, `ParsedRequest.resolve`, `worker.admission`), so fields, defaults, errors
and outputs are those of request and result lines.

    from worker.offline import LLM

    llm = LLM("tiny-llama")  # a preset, a local checkpoint folder or a hub id; engine options as keywords
    results = llm.generate(["The capital of France is", "1, 2, 3,"], sampling={"max_new_tokens": 8})
    print(results[0].text, results[0].token_ids, results[0].usage.completion_tokens)
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable
from typing import Any

from producer.store import validate_lines
from schemas.errors import InvalidRequest, RequestLineError
from schemas.request import CHAT_COMPLETIONS_URL, COMPLETIONS_URL, SamplingOverrides
from schemas.responses_body import RESPONSES_URL
from schemas.result import ResultLine
from worker.admission import to_engine_request, to_result_line
from worker.embedding.admission import ModelTask, kind_refusal, to_embedding_request
from worker.engine.api import EngineProtocol, EngineRequest
from worker.media.load import ImageAdmission
from worker.media.policy import MediaError, MediaPolicy
from worker.output_parsers import OutputParsing, chat_template_text

RESULT_POLL_SECONDS = 0.1
# Image requests an image-taking engine holds unstarted (the worker holds about one chunk job's, 64 by default):
# enough to fill a step's prefill, few enough that their pixels (~19 MB a 1024x768 picture) stay a few GB
IMAGE_REQUESTS_WAITING = 128

Input = (
    str | dict[str, Any]
)  # a prompt, or a request line: {"prompt"...}, {"messages"...}, an OpenAI line or body
Conversation = list[dict[str, Any]]


class InvalidRequests(ValueError):
    """Some inputs are invalid, so nothing ran. `errors` names each bad input (line N is input N, from 1) and
    field."""

    def __init__(self, errors: list[RequestLineError]):
        self.errors = errors
        super().__init__(f"{len(errors)} invalid input(s); nothing ran:\n" + "\n".join(map(str, errors)))


class LLM:
    """A model loaded once, for any number of `generate` and `chat` calls (one at a time)."""

    def __init__(
        self,
        model: str = "tiny-llama",
        *,
        tool_call_parser: str = "auto",
        reasoning_parser: str = "auto",
        media_policy: MediaPolicy | None = None,
        **engine_options: Any,
    ):
        """`model`: a preset, a local checkpoint folder or a hub id (org/name). `tool_call_parser`,
        `reasoning_parser`: as `cbq run`'s flags (worker/output_parsers). `media_policy`: where a chat's images
        may be read from (worker/media/policy.py; default: data: URLs only). `engine_options`: `EngineConfig`
        fields (`device`, `dtype`, `max_model_len`, `gpu_memory_utilization`, `num_kv_blocks`, ...)."""
        from worker.engine.engine_builder import build_engine
        from worker.engine.models import PRESETS
        from worker.model_names import check_model_name

        check_model_name(model, list(PRESETS))
        self.model = model
        self.engine: EngineProtocol = build_engine(model, **engine_options)
        template = chat_template_text(self.engine.tokenizer)
        self.output_parsing = OutputParsing.choose(tool_call_parser, reasoning_parser, template)
        self.media = ImageAdmission(media_policy or MediaPolicy(), self.engine.accepts_images, model)
        self._calls = itertools.count()

    def generate(
        self,
        prompts: Input | Iterable[Input],
        sampling: dict[str, Any] | SamplingOverrides | None = None,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
        return_token_ids: bool = True,
        progress: bool = True,
    ) -> list[ResultLine]:
        """Run every input to completion; one `ResultLine` per input, in input order.

        An input is a prompt string or a request line as a dict: `{"prompt": ...}`, `{"messages": [...]}`, an
        OpenAI Batch line, or an OpenAI request body (`{"model", "messages" | "prompt", ...}`). `sampling` holds
        defaults for every input (any sampling field, as `cbq submit`'s flags); values on an input win.
        Raises `InvalidRequests` (naming each bad input and field) before anything runs.
        A request the engine refuses (e.g. a prompt longer than the context) gets an error result instead.
        """
        items = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        defaults = (
            sampling if isinstance(sampling, SamplingOverrides) else SamplingOverrides(**(sampling or {}))
        )
        requests = _requests(items, defaults, chat_template_kwargs, return_token_ids)
        return self._run(requests, progress)

    def chat(
        self,
        conversations: Conversation | Iterable[Conversation],
        sampling: dict[str, Any] | SamplingOverrides | None = None,
        **options: Any,
    ) -> list[ResultLine]:
        """`generate` for chats: one conversation (a list of `{"role", "content"}` messages) or a list of them."""
        items: list[Any] = list(conversations)
        if items and isinstance(items[0], dict):  # one conversation
            items = [items]
        return self.generate([{"messages": messages} for messages in items], sampling, **options)

    def _run(self, requests: list, progress: bool) -> list[ResultLine]:
        """Run `requests`, fed to the engine while it has capacity, as the worker feeds it: a request is tokenized
        and its images read and decoded only when the engine can take it, and an engine that takes images holds at
        most IMAGE_REQUESTS_WAITING of them unstarted (their pixels made, not yet encoded: ~19 MB for a 1024x768
        picture), so a list of 10,000 image inputs never holds 10,000 pictures."""
        call = f"offline{next(self._calls)}"
        results: dict[int, ResultLine] = {}
        pending: dict[str, Any] = {}  # engine request id -> request
        task = ModelTask.of(self.engine)
        bar = _progress_bar(len(requests), progress)
        todo = iter(requests)
        more = True
        self.engine.start()
        try:
            num_tokens, started = 0, time.perf_counter()
            while more or pending:
                while more and self._can_take_more():
                    request = next(todo, None)
                    if request is None:
                        more = False
                        break
                    made = self._engine_request(request, task, call)
                    if isinstance(made, ResultLine):  # refused: this input fails alone
                        results[request.index] = made
                        bar.update(1)
                        continue
                    pending[made.request_id] = request
                    self.engine.add_request(made)
                for result in self.engine.get_results(timeout=RESULT_POLL_SECONDS):
                    request = pending.pop(result.request_id, None)
                    if request is None:
                        continue  # left over from an interrupted call
                    results[request.index] = to_result_line(request, result, self.engine.tokenizer, self.output_parsing)
                    num_tokens += result.usage.completion_tokens
                    bar.update(1)
                    bar.set_postfix_str(f"{num_tokens / (time.perf_counter() - started):.0f} output tok/s")
        finally:
            for request_id in pending:  # interrupted (Ctrl-C): nothing of this call keeps running
                self.engine.abort(request_id)
            self.engine.shutdown()
            bar.close()
        return [results[i] for i in range(len(requests))]

    def _can_take_more(self) -> bool:
        if not self.engine.has_capacity():
            return False
        return not self.engine.accepts_images or self.engine.num_unstarted() < IMAGE_REQUESTS_WAITING

    def _engine_request(self, request: Any, task: ModelTask, call: str) -> EngineRequest | ResultLine:
        """The engine's request for one input, or the error result of an input this model cannot run: the other
        kind (an embedding input for a generation model, or the reverse), an image it cannot take or this process
        cannot read, or a chat template that fails on this conversation."""
        refused = kind_refusal(request, task)
        if refused is not None:
            return refused
        tokenizer = self.engine.tokenizer
        try:
            if request.is_embedding:
                return to_embedding_request(request, tokenizer, task, call, time.time())
            return to_engine_request(request, tokenizer, call, time.time(), parsing=self.output_parsing, media=self.media)
        except MediaError as exc:
            return ResultLine(
                custom_id=request.custom_id,
                index=request.index,
                finish_reason="error",
                error=str(exc),
                error_code="invalid_value",
                error_param=exc.param,
            )
        except Exception as exc:
            return ResultLine(
                custom_id=request.custom_id,
                index=request.index,
                finish_reason="error",
                error=f"tokenization failed: {exc!r}",
            )


def _requests(items: list[Input], defaults: SamplingOverrides, chat_template_kwargs, return_token_ids: bool):
    """Validate every input as a request line (all errors at once) and resolve it as `cbq submit` would."""
    lines = [_as_line(item, i) for i, item in enumerate(items)]
    validated = validate_lines(json.dumps(line) for line, _ in lines)
    # As vLLM's LLM.generate: an invalid input raises before anything runs (a queue fails it alone instead).
    if refused := validated.refusal(strict=True):
        raise InvalidRequests(refused)
    out = []
    for index, (parsed, (_, is_body)) in enumerate(zip(validated.requests, lines, strict=True)):
        assert not isinstance(parsed, InvalidRequest), "refused above"
        if is_body:  # the custom_id was only the envelope's
            parsed = parsed.model_copy(update={"custom_id": None})
        out.append(parsed.resolve(index, defaults, return_token_ids, chat_template_kwargs))
    return out


def _as_line(item: Input, index: int) -> tuple[dict[str, Any], bool]:
    """(the request line for `item`, whether it is a bare OpenAI body wrapped in a Batch line here)."""
    if isinstance(item, str):
        return {"prompt": item}, False
    if not isinstance(item, dict):
        raise TypeError(f"an input is a prompt string or a request dict, got {type(item).__name__}")
    if "model" in item and not {"custom_id", "method", "url", "body"} & item.keys():
        url = CHAT_COMPLETIONS_URL if "messages" in item else RESPONSES_URL if "input" in item else COMPLETIONS_URL
        return {"custom_id": f"offline-body-{index}", "method": "POST", "url": url, "body": item}, True
    return item, False


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm  # type: ignore[import-untyped]  # transformers depends on it

    return tqdm(total=total, disable=not enabled, unit="req", desc="generating", dynamic_ncols=True)
