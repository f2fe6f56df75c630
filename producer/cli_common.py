"""Helpers shared by every `cbq` command, producer or worker side: reading input lines, printing a batch status.

Owns how the CLI reads JSONL input and shows a `BatchStatus`. Commands import this module, never each other.
"""

from __future__ import annotations

from schemas.status import BatchStatus


def read_lines(file) -> list[str]:
    """Lines split on newlines only: str.splitlines() would also split inside JSON strings at U+2028 etc."""
    return [line.rstrip("\n") for line in file]


def format_status(st: BatchStatus) -> str:
    name = f" ({st.name})" if st.name else ""
    eta = "-" if st.eta_seconds is None else f"{st.eta_seconds:.0f} s"
    return "\n".join(
        [
            f"batch {st.batch_id}{name} on queue {st.queue}: {st.state}",
            f"  total {st.num_total}  queued {st.num_queued}  running {st.num_running}  "
            f"completed {st.num_completed}  failed {st.num_failed}  cancelled {st.num_cancelled}",
            f"  tokens: prompt {st.prompt_tokens}  completion {st.completion_tokens}  gpu {st.gpu_seconds:.2f} s",
            f"  rate {st.requests_per_second:.1f} req/s  {st.completion_tokens_per_second:.1f} completion tok/s  "
            f"ETA {eta}",
        ]
    )


def status_json(st: BatchStatus) -> dict:
    return {**st.model_dump(), "state": st.state, "is_done": st.is_done}
