"""Pydantic models at cbq's edges (input lines, results, status) and the Redis key layout. Never imports torch.

- `schemas.request`: the three request-line shapes, sampling bounds, `parse_request_line`, the stored `Request`
- `schemas.result`: `ResultLine`, `Usage`, OpenAI Batch output lines
- `schemas.status`: `BatchStatus`, `WorkerStats`
- `schemas.errors`: `RequestLineError` (line number + field path + message)
- `schemas.keys`: every `cbq:` Redis key
"""
