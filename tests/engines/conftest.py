"""Fixtures of the engine tests: the real MiniLM, loaded once per module."""

from __future__ import annotations

import pytest

from tidegate.engines.embeddings import TransformersEmbeddings


@pytest.fixture(scope="module")
def in_process() -> TransformersEmbeddings:
    """MiniLM in this process, loaded."""
    engine = TransformersEmbeddings("minilm")
    engine.load()
    return engine
