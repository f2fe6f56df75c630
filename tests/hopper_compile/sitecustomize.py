"""Loaded at start-up by every Python process whose PYTHONPATH holds this folder (the fixture
`compile_launches_for_hopper` in tests/worker/engine/conftest.py puts it first while a recorded interpreter test
runs, and the test's interpreter subprocesses inherit it). With CBQ_RECORD_TRITON_LAUNCHES set, it records each Triton
launch that Triton's interpreter runs (the kernel, its argument types and constexpr values, its launch options) as
one JSON line in that file, so the fixture can compile exactly those specializations for sm90."""

import os

if os.environ.get("CBQ_RECORD_TRITON_LAUNCHES"):
    from tests.hopper_compile.recorder import install

    install(os.environ["CBQ_RECORD_TRITON_LAUNCHES"])
