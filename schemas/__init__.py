"""Pydantic models at cbq's edges (input lines, results, status) and the Redis key layout. Never imports torch.

- `schemas.limits`: every bound on a request (plain constants: the schemas, the engine and the docs read them)
- `schemas.sampling`: the sampling fields (one definition) and `OutputConstraint`
- `schemas.chat`: chat messages and chat-template variables
- `schemas.openai_body`: OpenAI Batch lines and the completions and chat bodies
- `schemas.lines`: cbq's prompt and chat lines, `parse_request_line`, the stored `Request`
- `schemas.request`: the names the modules above replaced, re-exported for older imports
- `schemas.result`: `ResultLine`, `Usage`, OpenAI Batch output lines
- `schemas.output_parts`: `Sample` and `Usage`, which result lines and the Responses output both read
- `schemas.status`: `BatchStatus`, `WorkerStats`
- `schemas.errors`: `RequestLineError` (line number + field path + message)
- `schemas.keys`: every `cbq:` Redis key
"""
