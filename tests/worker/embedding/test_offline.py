"""`worker.offline.LLM` with an embedding checkpoint: `{"input": ...}` inputs embed, prompts fail alone (and the
reverse on a generation model)."""

from __future__ import annotations

from worker.offline import LLM


def test_llm_embeds_inputs_and_refuses_other_kinds(embedding_checkpoints):
    llm = LLM(str(embedding_checkpoints["bert"]), device="cpu")
    one, ids, prompt = llm.generate([{"custom_id": "a", "input": "hello there"}, {"input": [5, 6, 7]}, "The capital"],
                                    progress=False)
    assert one.finish_reason == "stop" and len(one.embedding) == llm.engine.spec.dimension
    assert one.usage.prompt_tokens > 0 and one.usage.completion_tokens == 0
    assert ids.finish_reason == "stop" and ids.usage.prompt_tokens == 3
    assert prompt.finish_reason == "error" and "embedding model" in prompt.error


def test_a_generation_model_refuses_embedding_inputs():
    llm = LLM("tiny-llama", device="cpu")
    [result] = llm.generate([{"input": "hello"}], progress=False)
    assert result.finish_reason == "error" and result.error_code == "invalid_value"
    assert "generation model" in result.error
