"""Model families, as declarations: `spec.py` is the typed declaration a family fills in (its layers' linears with
their parallel layout and quantization, norm kind and placement, activation, scales, soft-caps); one module per
family (`llama.py`, `mistral.py`, `qwen2.py`, ...) reads a config into it; `registry.py` maps a config's
model_type to its module, one line each. Adding a family = one module + one registry line + its tests.

Below the layers, the decoder and the loader (models/), which all read these declarations; they import none of them.
"""
