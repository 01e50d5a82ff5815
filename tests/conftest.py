"""Test-wide settings: no model hub, ever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONVERSION_TIMEOUT_S = 900.0  # a minute on an idle 2-core machine

# The interpreted modules, as `make test` runs them, even where `make compiled` left a build
# beside them (tests marked `spies` patch methods a compiled caller would not see);
# `make native-check` sets 0 to test the build.
os.environ.setdefault("TIDEGATE_PURE_PYTHON", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """SmolLM2 converted once for the whole run, into the machine's tidegate cache.

    The conversion (about a minute) runs in a child process, before any server starts that
    serves smollm2: their start-up deadlines then cover loading, not converting.
    """
    code = (
        "from tidegate.engines import smollm2, model_folder;"
        "print(model_folder.ensure_converted(smollm2.gguf_path()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=CONVERSION_TIMEOUT_S,
        check=True,
    )
    return Path(done.stdout.strip().splitlines()[-1])
