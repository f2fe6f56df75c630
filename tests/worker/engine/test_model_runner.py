"""The CUDA-graph capture inputs, exercised eagerly on CPU: a padded decode bucket runs end to end."""

from __future__ import annotations

import torch

from worker.engine.config import EngineConfig
from worker.engine.cuda_graphs import decode_capture_meta, fill_padding_decode
from worker.engine.engine import Engine


def test_capture_inputs_run_a_padded_decode_bucket(tiny_models):
    model, tok = tiny_models("tiny-qwen3")
    engine = Engine(model, tok, EngineConfig(device="cpu"))
    runner = engine.runner
    for slot_index in (0, 1):
        slot = runner.builder.slots[slot_index]
        meta = decode_capture_meta(slot_index, 4, engine.max_model_len)
        fill_padding_decode(slot, 4)
        prev = runner.builder.slots[1 - slot_index].sampled_dev
        with torch.inference_mode():
            logits = runner._forward_slot(slot, meta, prev, logits_indices=0)
        assert logits.shape == (4, model.config.vocab_size)
        assert torch.isfinite(logits).all()
