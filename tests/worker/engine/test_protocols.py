"""`Engine`, `FakeEngine` and `EmbeddingEngine` satisfy `EngineProtocol`; both tokenizers satisfy `TokenizerProtocol`.

Checked twice: at run time (member names, through `runtime_checkable`) and by mypy, which `.ci/run` points
at this file, so the assignments below fail type checking when a signature drifts from the protocol.
"""

from __future__ import annotations

from worker.embedding.engine import EmbeddingEngine
from worker.engine.api import EngineProtocol, TokenizerProtocol
from worker.engine.engine import Engine
from worker.engine.tokenizer import ByteTokenizer, HFTokenizer
from worker.fake_engine import FakeEngine


def _engine_is_an_engine(engine: Engine) -> EngineProtocol:
    return engine


def _fake_engine_is_an_engine(engine: FakeEngine) -> EngineProtocol:
    return engine


def _embedding_engine_is_an_engine(engine: EmbeddingEngine) -> EngineProtocol:
    return engine


def _byte_tokenizer_is_a_tokenizer(tokenizer: ByteTokenizer) -> TokenizerProtocol:
    return tokenizer


def _hf_tokenizer_is_a_tokenizer(tokenizer: HFTokenizer) -> TokenizerProtocol:
    return tokenizer


def test_fake_engine_and_byte_tokenizers_satisfy_the_protocols():
    engine = FakeEngine()
    assert isinstance(engine, EngineProtocol)
    assert isinstance(engine.tokenizer, TokenizerProtocol)
    assert isinstance(ByteTokenizer(), TokenizerProtocol)


def test_engine_satisfies_the_engine_protocol():
    engine = Engine.from_model("tiny-llama", device="cpu", num_kv_blocks=8)
    assert isinstance(engine, EngineProtocol)
    assert isinstance(engine.tokenizer, TokenizerProtocol)


def test_the_fake_engine_tokenizer_is_the_byte_tokenizer_without_bos():
    fake, real = FakeEngine().tokenizer, ByteTokenizer()
    assert fake.encode("hé") == list("hé".encode()) and real.encode("hé") == [real.bos_token_id, *fake.encode("hé")]
    assert fake.decode(real.encode("hé")) == real.decode(real.encode("hé")) == "hé"
    chat = [{"role": "user", "content": "hi"}]
    assert real.encode_chat(chat) == [real.bos_token_id, *fake.encode_chat(chat)]
