"""`cbq serve`: an OpenAI-compatible Files and Batches API over cbq's Redis (optional extra `server`).

- `cli`: the `serve` command (API keys, the loopback rule, uvicorn)
- `app`: routes, parameter checks, API-key middleware, OpenAI-shaped errors
- `service`: the batch lifecycle (validate and submit, finalize into output files, cancel, expire)
- `records`: the OpenAI batch records in Redis and the batch object they map to
- `files`: uploaded and output files on the server's disk, with their expiry
"""
