"""Embedding checkpoints for the embedding tests, built once per session (random weights, trained tokenizers)."""

from __future__ import annotations

import pytest

from tests.fixtures.embedding_checkpoints import EMBEDDING_FAMILIES, build_embedding_checkpoint


@pytest.fixture(scope="session")
def embedding_checkpoints(tmp_path_factory):
    """family name -> folder of its sentence-transformers checkpoint."""
    root = tmp_path_factory.mktemp("embedding-checkpoints")
    return {name: build_embedding_checkpoint(root / name, name) for name in EMBEDDING_FAMILIES}
