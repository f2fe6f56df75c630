"""The embedding engine: one sentence-transformers checkpoint, batched forward passes, pooled vectors.

Owns the pending requests, the batches they are run in and the engine's counters. It satisfies
`EngineProtocol` (thread-safe `add_request` / `get_results` / `abort`, a step loop in a thread), so the queue
worker, `cbq run` and `cbq serve`'s workers run it as they run the generation engine; it knows nothing about
Redis or request lines (admission turns those into `EmbeddingRequest`s: worker/embedding/admission.py).

Each step runs one batch through one of two forwards (`forward`), then pools the last hidden states (pooling.py):
- "packed" (the default where it runs the model): the batch's inputs laid end to end in one row of tokens, no
  padding. Decoders whose family cbq's owned decoder runs (Qwen3-Embedding, gte-Qwen2, e5-mistral) go through the
  owned decoder's varlen prefill with a scratch KV cache (packed.py); BERT, RoBERTa and XLM-RoBERTa encoders
  through transformers' own modules, each input attending to itself (packed_encoder.py). A batch holds at most
  `max_batch_tokens` real tokens.
- "transformers" (ModernBERT, and any model with `decoder="hf"`): transformers' base model (`AutoModel`: no LM
  head, no KV cache kept; a decoder runs its prompt once, as a prefill that generates nothing), inputs padded on
  the right to the batch's longest; at most `max_batch_tokens` padded tokens.
Batches are made by length either way: requests fall into buckets whose lengths differ by at most `BUCKET_RATIO`,
a batch holds requests of one bucket (the oldest waiting request's first), so padding is at most 1 - 1/BUCKET_RATIO
of a padded batch's tokens, and a packed batch's inputs take similar tiles in the attention kernel.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.embedding.checkpoint import (
    EMBED,
    EmbeddingCheckpointError,
    EmbeddingSpec,
    ModelKind,
    read_embedding_spec,
)
from worker.embedding.packed import PackedDecoderForward, packed_unsupported_reason
from worker.embedding.packed_encoder import PackedEncoderForward, packed_encoder_unsupported_reason
from worker.embedding.pooling import pool
from worker.engine.api import (
    EngineRequest,
    EngineResult,
    EngineStats,
    ErrorCode,
    FinishReason,
    TokenizerProtocol,
    Usage,
)

BUCKET_RATIO = 1.25  # lengths in one bucket differ by at most this factor
DEFAULT_MAX_BATCH_TOKENS = {"cuda": 65536, "cpu": 4096}  # padded tokens in one transformers forward
DEFAULT_MAX_PACKED_TOKENS = {"cuda": 32768, "cpu": 4096}  # tokens in one packed forward (no padding)
PACKED, TRANSFORMERS = "packed", "transformers"  # the two forwards (module docstring)
DEFAULT_MAX_BATCH_SIZE = 512
PENDING_BATCHES = 8  # `has_capacity` while fewer than this many full batches wait: buckets fill from them


@dataclass
class EmbeddingRequest(EngineRequest):
    """An input to embed: `prompt_ids` as tokenized (the checkpoint's prompt already put before a text input).
    `dimensions`: Matryoshka truncation, then normalized again (checked against the model at admission)."""

    dimensions: int | None = None


@dataclass
class EmbeddingResult(EngineResult):
    """`embedding`: the pooled (normalized, truncated) vector as floats; empty for a failed request."""

    embedding: list[float] = field(default_factory=list)


@dataclass
class _Pending:
    request: EmbeddingRequest
    arrival: float  # time.time()
    bucket: int


def bucket_of(num_tokens: int) -> int:
    return int(math.floor(math.log(max(num_tokens, 1)) / math.log(BUCKET_RATIO)))


class EmbeddingEngine:
    """An embedding model behind `EngineProtocol`. Build it with `from_model(path)`."""

    model_kind: ModelKind = EMBED
    sampling_defaults: dict[str, Any] = {}

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: TokenizerProtocol,
        spec: EmbeddingSpec,
        pad_token_id: int,
        device: torch.device,
        max_batch_tokens: int | None = None,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        decoder: str = "auto",
    ):
        """`decoder`, as the generation engine's setting: "auto" runs the packed forward where it runs the model (a
        decoder family the owned decoder implements, a BERT-style encoder) and transformers' padded one elsewhere, "owned" the packed forward or a
        ValueError, "hf" transformers' forward."""
        self.model = model
        self._tokenizer = tokenizer
        self.spec = spec
        self.pad_token_id = pad_token_id
        self.device = device
        self.forward = choose_forward(model, spec, decoder)
        self._packed: PackedDecoderForward | PackedEncoderForward | None = None
        if self.forward == PACKED and spec.is_decoder:
            self._packed = PackedDecoderForward(model, device, spec.max_seq_length)
        elif self.forward == PACKED:
            self._packed = PackedEncoderForward(model, device)
        defaults = DEFAULT_MAX_PACKED_TOKENS if self.forward == PACKED else DEFAULT_MAX_BATCH_TOKENS
        default_tokens = max(defaults.get(device.type, 16384), spec.max_seq_length)
        self.max_batch_tokens = max_batch_tokens or default_tokens  # by default, room for the longest input
        self.max_batch_size = max_batch_size
        embeddings: Any = model.get_input_embeddings()  # type: ignore[operator]  # transformers' PreTrainedModel
        self.num_token_ids = max(tokenizer.vocab_size, int(embeddings.num_embeddings))  # ids the model can look up
        if self.max_batch_tokens < spec.max_seq_length:
            raise ValueError(
                f"max_num_batched_tokens {self.max_batch_tokens} is below the model's max_seq_length "
                f"{spec.max_seq_length}: its longest inputs could not run"
            )
        self.accepts_images = False  # text embedding models: a line with images fails alone at admission
        self._lock = threading.Condition()
        self._pending: deque[_Pending] = deque()
        self._results: list[EngineResult] = []
        self._results_ready = self._lock  # one condition: new requests for the loop, new results for readers
        self._cancelled: set[str] = set()
        self._stats = EngineStats()
        self._num_running = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._started_at: float | None = None
        self._last_finished = 0.0  # time.time() when the last batch's vectors came back

    # --- building ----------------------------------------------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        path: str,
        device: str = "auto",
        dtype: str = "auto",
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        decoder: str = "auto",
        **ignored: Any,
    ) -> EmbeddingEngine:
        """Load the sentence-transformers checkpoint in folder `path`. The generation engine's settings that mean
        nothing here (KV cache, CUDA graphs, scheduling) are accepted and ignored, so the worker's flags apply
        to both kinds; `max_num_batched_tokens` bounds a batch's tokens (padded ones included in transformers'
        forward), `max_num_seqs` its inputs, `decoder` picks the forward (`__init__`)."""
        from transformers import AutoModel, AutoTokenizer

        from worker.engine.models.loader import resolve_device, resolve_dtype
        from worker.engine.tokenizer import HFTokenizer

        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        hf_tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        tokenizer_max = getattr(hf_tokenizer, "model_max_length", None)
        spec = read_embedding_spec(path, tokenizer_max if tokenizer_max and tokenizer_max < 10**8 else None)
        model = AutoModel.from_pretrained(path, dtype=torch_dtype, trust_remote_code=False).to(torch_device).eval()
        pad = hf_tokenizer.pad_token_id
        if pad is None:
            pad = getattr(model.config, "pad_token_id", None) or 0
        return cls(
            model,
            HFTokenizer(hf_tokenizer),
            spec,
            int(pad),
            torch_device,
            max_batch_tokens=max_num_batched_tokens,
            max_batch_size=max_num_seqs or DEFAULT_MAX_BATCH_SIZE,
            decoder=decoder,
        )

    def describe(self, model: str, served_name: str) -> str:
        """The worker's start-up line for this engine."""
        spec = self.spec
        kind = "decoder" if spec.is_decoder else "encoder"
        return (
            f"engine: embedding model {model} ({spec.model_type} {kind}, {spec.pooling} pooling"
            f"{', normalized' if spec.normalize else ''}, dimension {spec.dimension}), served as {served_name}, "
            f"{self.device}, {str(next(self.model.parameters()).dtype).removeprefix('torch.')}; inputs up to "
            f"{spec.max_seq_length} tokens, {self.forward} forward, batches up to {self.max_batch_tokens} tokens / "
            f"{self.max_batch_size} inputs"
        )

    # --- EngineProtocol ----------------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> TokenizerProtocol:
        return self._tokenizer

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._stopping = False
            self._started_at = time.monotonic()
            self._thread = threading.Thread(target=self._loop, name="cbq-embedding-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def add_request(self, req: EngineRequest) -> None:
        """Queue `req` (an `EmbeddingRequest`; a plain `EngineRequest` embeds at the model's dimension). An
        input that cannot run comes back at once as an ERROR result with its 400 code."""
        request = req if isinstance(req, EmbeddingRequest) else EmbeddingRequest(req.request_id, req.prompt_ids)
        request.arrival_time = req.arrival_time if req.arrival_time is not None else time.time()
        refusal = self.refusal(request)
        with self._lock:
            if refusal is not None:
                code, message = refusal
                self._finish(self._failed(request, message, code))
                return
            self._pending.append(_Pending(request, request.arrival_time, bucket_of(len(request.prompt_ids))))
            self._lock.notify_all()

    def refusal(self, request: EmbeddingRequest) -> tuple[ErrorCode, str] | None:
        """Why `request` cannot run on this model (its 400 code and message), or None."""
        ids = request.prompt_ids
        if not ids:
            return ErrorCode.INVALID_PROMPT, "the input is empty"
        if len(ids) > self.spec.max_seq_length:
            return (
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"the input has {len(ids)} tokens; this model embeds at most {self.spec.max_seq_length}",
            )
        if min(ids) < 0 or max(ids) >= self.num_token_ids:
            return ErrorCode.INVALID_PROMPT, f"token ids must be in [0, {self.num_token_ids})"
        reason = self.spec.check_dimensions(request.dimensions)
        if reason is not None:
            return ErrorCode.INVALID_VALUE, reason
        return None

    def abort(self, request_id: str) -> None:
        with self._lock:
            for item in self._pending:
                if item.request.request_id == request_id:
                    self._pending.remove(item)
                    self._finish(self._cancelled_result(item.request))
                    return
            self._cancelled.add(request_id)  # in the batch now running: dropped when it ends

    def get_results(self, timeout: float | None = 0) -> list[EngineResult]:
        with self._lock:
            if not self._results and timeout != 0:
                self._results_ready.wait(timeout)
            results, self._results = self._results, []
            return results

    def has_capacity(self) -> bool:
        with self._lock:
            return len(self._pending) < PENDING_BATCHES * self.max_batch_size

    def num_unstarted(self) -> int:
        """Inputs added and not yet in a batch: what the worker's fair-sharing bound counts."""
        with self._lock:
            return len(self._pending)

    def stats(self) -> EngineStats:
        with self._lock:
            stats = EngineStats(**vars(self._stats))
            stats.num_running = self._num_running
            stats.num_waiting = len(self._pending)
            if self._started_at is not None:
                stats.wall_seconds = time.monotonic() - self._started_at
            return stats

    # --- the step loop -----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        # One batch in flight: batch N+1 is launched before batch N's vectors are copied back and turned into
        # results, so that host work overlaps the device's (the copy is the loop's one sync).
        in_flight: _InFlight | None = None
        while True:
            with self._lock:
                while not self._pending and not self._stopping and in_flight is None:
                    self._lock.wait()
                if self._stopping:
                    return
                batch = self._take_batch() if self._pending else []
                self._num_running = len(batch) + (len(in_flight.batch) if in_flight else 0)
            launched = None
            if batch:
                try:
                    launched = _InFlight(batch, self.launch([i.request.prompt_ids for i in batch]), time.time())
                except Exception as exc:  # a failed forward fails its batch, not the engine
                    self._record(batch, None, f"the forward pass failed: {exc!r}", time.time(), time.time())
            if in_flight is not None:
                self._complete(in_flight)
            in_flight = launched

    def _complete(self, done: _InFlight) -> None:
        try:
            vectors, error = self.finish(done.pooled, [i.request.dimensions for i in done.batch]), None
        except Exception as exc:
            vectors, error = None, f"the forward pass failed: {exc!r}"
        finished = time.time()
        # device time: from its launch, or from the end of the batch before it (which held the device until then)
        started = max(done.launched_at, self._last_finished)
        self._last_finished = finished
        self._record(done.batch, vectors, error, started, finished)

    def _take_batch(self) -> list[_Pending]:
        """The oldest request's bucket, oldest first, up to the batch bounds. Called under the lock."""
        bucket = self._pending[0].bucket
        batch: list[_Pending] = []
        longest = total = 0
        for item in self._pending:
            if item.bucket != bucket:
                continue
            length = max(longest, len(item.request.prompt_ids))
            # the batch's tokens with this input: its real ones when packed, else padded to the longest
            tokens = total + len(item.request.prompt_ids) if self._packed is not None else length * (len(batch) + 1)
            if batch and (len(batch) >= self.max_batch_size or tokens > self.max_batch_tokens):
                break
            batch.append(item)
            longest, total = length, total + len(item.request.prompt_ids)
        taken = {id(item) for item in batch}
        self._pending = deque(item for item in self._pending if id(item) not in taken)
        return batch

    def _record(
        self, batch: list[_Pending], vectors: list[list[float]] | None, error: str | None, started: float,
        finished: float,
    ) -> None:
        seconds = finished - started
        num_tokens = sum(len(item.request.prompt_ids) for item in batch)
        with self._lock:
            self._stats.steps += 1
            self._stats.prompt_tokens += num_tokens
            self._stats.busy_seconds += seconds
            self._num_running = max(0, self._num_running - len(batch))
            for i, item in enumerate(batch):
                request = item.request
                if request.request_id in self._cancelled:
                    self._cancelled.discard(request.request_id)
                    self._finish(self._cancelled_result(request))
                    continue
                if vectors is None:
                    self._finish(self._failed(request, error or "the forward pass failed", None))
                    continue
                num = len(request.prompt_ids)
                usage = Usage(
                    prompt_tokens=num,
                    gpu_seconds=seconds * num / num_tokens,
                    queue_seconds=max(0.0, started - item.arrival),
                    ttft_seconds=max(0.0, finished - item.arrival),
                    latency_seconds=max(0.0, finished - item.arrival),
                )
                self._finish(EmbeddingResult(request.request_id, "", [], FinishReason.STOP, usage,
                                             embedding=vectors[i]))

    def _finish(self, result: EngineResult) -> None:
        self._results.append(result)
        self._results_ready.notify_all()

    @staticmethod
    def _failed(request: EmbeddingRequest, message: str, code: ErrorCode | None) -> EmbeddingResult:
        usage = Usage(prompt_tokens=len(request.prompt_ids))
        return EmbeddingResult(request.request_id, "", [], FinishReason.ERROR, usage, error=message, error_code=code)

    @staticmethod
    def _cancelled_result(request: EmbeddingRequest) -> EmbeddingResult:
        return EmbeddingResult(request.request_id, "", [], FinishReason.CANCELLED, Usage())

    # --- the forward -------------------------------------------------------------------------------------------

    def embed(self, batch_ids: list[list[int]], dimensions: list[int | None] | None = None) -> list[list[float]]:
        """One batch's embeddings (as the requests get them), in order: `launch`, then `finish`."""
        return self.finish(self.launch(batch_ids), dimensions or [None] * len(batch_ids))

    @torch.inference_mode()
    def launch(self, batch_ids: list[list[int]]) -> torch.Tensor:
        """Queue one batch's forward, pooling and normalization on the device (no sync): the [batch, dim] fp32
        vectors. Packed (packed.py, packed_encoder.py), or through transformers' model with inputs padded on the right to the longest
        (real tokens keep positions 0..n-1; a decoder's causal mask keeps them from seeing the pads, an encoder's
        padding mask does)."""
        if self._packed is not None:
            return self._packed.launch(batch_ids, self.spec.pooling, self.spec.normalize)
        longest = max(len(ids) for ids in batch_ids)
        lengths_cpu = torch.tensor([len(ids) for ids in batch_ids], dtype=torch.long)
        input_ids_cpu = torch.full((len(batch_ids), longest), self.pad_token_id, dtype=torch.long)
        for row, ids in enumerate(batch_ids):
            input_ids_cpu[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask_cpu = (torch.arange(longest).unsqueeze(0) < lengths_cpu.unsqueeze(1)).long()
        if self.device.type == "cuda":  # pinned, so that the copies are asynchronous
            input_ids_cpu, mask_cpu, lengths_cpu = (t.pin_memory() for t in (input_ids_cpu, mask_cpu, lengths_cpu))
        input_ids = input_ids_cpu.to(self.device, non_blocking=True)
        mask = mask_cpu.to(self.device, non_blocking=True)
        kwargs: dict[str, Any] = {"input_ids": input_ids}
        if self.spec.is_decoder:
            # A prefill only: nothing is kept after the batch. No padding mask: under the causal mask a real token
            # sees only the tokens before it, all real (the pads come after), so the outputs at real positions are
            # the same, and attention runs its plain causal kernel instead of a masked one.
            kwargs["use_cache"] = False
        else:
            kwargs["attention_mask"] = mask
        hidden = self.model(**kwargs).last_hidden_state
        pooled = pool(hidden, mask, lengths_cpu.to(self.device, non_blocking=True), self.spec.pooling).float()
        if self.spec.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled

    @torch.inference_mode()
    def finish(self, pooled: torch.Tensor, dimensions: list[int | None]) -> list[list[float]]:
        """The launched batch's vectors on the host (waits for the device), each cut to its request's Matryoshka
        `dimensions` and normalized again when the model normalizes."""
        return truncate_rows(pooled.cpu(), self.spec.normalize, dimensions)


@dataclass
class _InFlight:
    batch: list[_Pending]
    pooled: torch.Tensor  # on the device, until `finish` copies it back
    launched_at: float


def truncate_rows(rows: torch.Tensor, normalize: bool, dimensions: list[int | None]) -> list[list[float]]:
    """Each row cut to its Matryoshka `dimensions` (None: whole), normalized again when the model normalizes (as
    sentence-transformers' `truncate_dim` after its Normalize module, then normalization)."""
    out = []
    for row, dims in zip(rows, dimensions, strict=True):
        if dims is not None and dims < row.shape[0]:
            row = row[:dims]
            if normalize:
                row = torch.nn.functional.normalize(row, p=2, dim=-1)
        out.append(row.tolist())
    return out


def choose_forward(model: torch.nn.Module, spec: EmbeddingSpec, decoder: str) -> str:
    """PACKED or TRANSFORMERS for `model` under the generation engine's `decoder` setting (`EmbeddingEngine`)."""
    if decoder not in ("auto", "owned", "hf"):
        raise ValueError(f"decoder must be one of auto, owned, hf; got {decoder!r}")
    if decoder == "hf":
        return TRANSFORMERS
    reason = packed_unsupported_reason(model) if spec.is_decoder else packed_encoder_unsupported_reason(model)
    if reason is None:
        return PACKED
    if decoder == "owned":
        raise EmbeddingCheckpointError(f"decoder 'owned': the packed embedding forward cannot run this model ({reason})")
    return TRANSFORMERS


def build_embedding_engine(model: str, tensor_parallel_size: int = 1, **config: Any) -> EmbeddingEngine:
    """The embedding engine for checkpoint folder `model`, from the generation engine's settings (see
    `EmbeddingEngine.from_model` for the ones it reads). Raises `ModelLoadError` for what it cannot run."""
    from worker.engine.models import ModelLoadError

    if tensor_parallel_size > 1:
        raise ModelLoadError("an embedding model runs on one GPU: give --tensor-parallel-size 1 (or run one worker per GPU)")
    try:
        return EmbeddingEngine.from_model(model, **config)
    except EmbeddingCheckpointError as exc:
        raise ModelLoadError(str(exc)) from None
