"""The producer side of cbq: submitting batches and reading them back. Never imports torch.

- `producer.cli`: the `cbq` command group (submit, status, wait, results, cancel, stats; worker/run/bench lazily)
- `producer.submit`: validate lines, dedupe, stage requests, commit a batch in one transaction
- `producer.batches`: status, results in input order, cancel, listings
- `producer.result_store`: the only writer of results and batch counters (used by the worker and cancel)
- `producer.options`: shared click options; `producer.settings`: defaults, env vars, Redis connection
- `producer.lazy_group`: a click group that imports heavy subcommands only when they run
"""
