"""The rq job payload of one chunk: which requests of which batch it carries. JSON only (rq's JSONSerializer).

The requests themselves are stored once, in `cbq:batch:{id}:requests`; a chunk job carries only the batch id
and the index range, so a job stays a few dozen bytes whatever the prompts' size.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The function rq records for a chunk job. Only `cbq worker` runs chunks; a plain `rq worker` that picks one up
# calls this function, which fails the job with a message saying so.
CHUNK_FUNC = "worker.chunk_job.run_chunk"


class ChunkPayload(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    batch_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_-]+$")
    start: int = Field(ge=0)  # first request index
    stop: int = Field(ge=1)  # one past the last

    @model_validator(mode="after")
    def _non_empty(self):
        if self.stop <= self.start:
            raise ValueError(f"empty chunk range [{self.start}, {self.stop})")
        return self

    @property
    def indices(self) -> range:
        return range(self.start, self.stop)
