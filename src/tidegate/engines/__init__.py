"""Engines: one protocol per task, several implementations (transformers, simulated).

``build_engine`` is the one place that maps a model name and engine kind to an instance;
heavy imports (torch, transformers) happen only inside the transformers engines.
"""

from __future__ import annotations

from tidegate.engines.base import (
    EmbeddingEngine,
    Engine,
    GenerationEngine,
    MemoryReport,
    ModelCard,
    SamplingParams,
    TokenEvent,
)
from tidegate.engines.registry import build_engine, known_models

__all__ = [
    "EmbeddingEngine",
    "Engine",
    "GenerationEngine",
    "MemoryReport",
    "ModelCard",
    "SamplingParams",
    "TokenEvent",
    "build_engine",
    "known_models",
]
