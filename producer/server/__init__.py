"""`cbq serve`: an OpenAI-compatible Files and Batches API over cbq's Redis (optional extra `server`).

- `cli`: the `serve` command (API keys, the loopback rule, the Redis client's timeouts, uvicorn)
- `app`: routes, parameter checks, who sees which file, OpenAI-shaped errors for every status
- `auth`: API keys, their projects and admin keys; the middleware that says who a request acts for
- `limits`: body sizes while they stream, header/body timeouts, the connection cap
- `service`: the batch lifecycle (validate and submit, finalize into output files, cancel, expire)
- `batch_object`: a batch record (`producer.store.api_batches`) and its cbq status as OpenAI's batch object
- `files`: uploaded and output files on the server's disk, with their project and expiry
"""
