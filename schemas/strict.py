"""`StrictModel`, the base of every input model: the one place that says how strictly input is read."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    # strict: "0.5" is not a temperature and 1 is not `true`; NaN/inf never make sense here; unknown fields
    # are refused by name rather than ignored.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
