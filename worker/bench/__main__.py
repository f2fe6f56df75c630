"""`python -m worker.bench engine|queue|e2e ...`: the same commands as `cbq bench`."""

from worker.bench import bench

bench(prog_name="python -m worker.bench")
