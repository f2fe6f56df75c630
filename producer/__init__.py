"""The producer side of cbq and the base the worker builds on: submitting batches, reading them back, the CLI.
Never imports torch, and never imports `worker` (the worker imports this package, not the reverse).

- `producer.client`: the Python client (submit, status, wait, results, cancel) that the commands use
- `producer.server`: `cbq serve`, OpenAI's Files and Batches API over cbq (the optional `server` extra)
- `producer.cli`: the `cbq` root group and the producer commands (submit, status, wait, results, cancel, stats)
- `producer.lazy_group`: command discovery through `cbq.commands` entry points (worker, run and bench plug in)
- `producer.cli_common`: helpers every command shares (input lines, status text, result files)
- `producer.options`: shared click options; `producer.settings`: defaults, env vars, Redis connection
- `producer.store`: every read and write of cbq's Redis keys (submit, results, status, cancel, worker stats)
"""
