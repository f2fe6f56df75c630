"""Loaded at start-up by every Python process whose PYTHONPATH holds this folder (test_kernels_compile_for_hopper.py
puts it first for the interpreter tests it runs). With CBQ_RECORD_TRITON_LAUNCHES set, it records each Triton launch
that Triton's interpreter runs (the kernel, its argument types and constexpr values, its launch options) as one JSON
line in that file, so the test can compile exactly those specializations for sm90."""

import os

if os.environ.get("CBQ_RECORD_TRITON_LAUNCHES"):
    from tests.hopper_compile.recorder import install

    install(os.environ["CBQ_RECORD_TRITON_LAUNCHES"])
