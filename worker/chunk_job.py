"""The function rq records for chunk jobs (`schemas.chunk.CHUNK_FUNC`).

`cbq worker` never calls it: it expands chunk jobs into engine requests itself. A plain `rq worker` listening
on a cbq queue would call it, so it fails the job with an explanation instead of doing something surprising.
"""


def run_chunk(batch_id: str, start: int, stop: int) -> None:
    raise RuntimeError(
        f"chunk {batch_id}[{start}:{stop}] must be run by `cbq worker`, not by a plain `rq worker`; "
        "requeue it with `rq requeue --all` once a cbq worker listens on this queue"
    )


def undecodable_job() -> None:
    """Recorded by the placeholder of a job no worker could decode (`worker.job_quarantine`); never runs."""
    raise RuntimeError("this job's data could not be decoded; see its failure message")
