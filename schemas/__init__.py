"""Pydantic models at cbq's edges (input lines, results, status) and the Redis key layout. Never imports torch.

- `schemas.request`: the request-line shapes, the sampling fields (one definition), `parse_request_line`, `Request`
- `schemas.result`: `ResultLine`, `Usage`, OpenAI Batch output lines
- `schemas.status`: `BatchStatus`, `WorkerStats`
- `schemas.errors`: `RequestLineError` (line number + field path + message)
- `schemas.keys`: every `cbq:` Redis key
"""
