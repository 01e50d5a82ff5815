"""Test-wide settings: no model hub, ever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONVERSION_TIMEOUT_S = 900.0  # a minute on an idle 2-core machine

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


# Seconds each of the longest files took (summed test times, a `-n 3` run of 2026-12-02).
# `make test` hands whole files to its workers in collection order (`--dist loadfile
# --no-loadscope-reorder`); xdist's own reorder puts the files with the most tests first,
# which left one-test files of a minute or more (observability, the real minilm profile,
# Ray Serve) to start last, on one worker, while the others idled. Longest first instead
# (the longest-processing-time rule): a file not listed keeps its place after these.
LONGEST_FILES_S = {
    "tests/control/test_ray.py": 162,
    "tests/ops/test_doctor_e2e.py": 130,
    "tests/profile/test_profile_e2e.py": 114,
    "tests/ops/test_observability_e2e.py": 82,
    "tests/worker/test_simulated_worker.py": 72,
    "tests/gateway/test_serve.py": 70,
    "tests/faults/test_faults.py": 67,
    "tests/control/test_ray_serve_e2e.py": 64,
    "tests/profile/test_profile_minilm_e2e.py": 64,
    "tests/engines/test_embeddings.py": 63,
    "tests/sim/test_fluid.py": 61,
    "tests/worker/test_smollm2_conversion.py": 60,
    "tests/engines/test_process.py": 59,
    "tests/worker/test_engine_failure.py": 56,
    "tests/control/test_ray_address_e2e.py": 47,
    "tests/control/test_k8s.py": 46,
    "tests/profile/test_profile_generation_e2e.py": 46,
    "tests/gateway/test_fuzz.py": 45,
    "tests/gateway/test_smollm2.py": 45,
    "tests/worker/test_real_worker.py": 42,
    "tests/profile/test_through_gateway.py": 39,
    "tests/gateway/test_scheduling.py": 35,
    "tests/gateway/test_dashboard_browser.py": 32,
    "tests/control/test_local.py": 32,
    "tests/gateway/test_shutdown.py": 31,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, each file's tests in their own order (a stable sort)."""
    items.sort(key=lambda item: -LONGEST_FILES_S.get(item.nodeid.split("::", 1)[0], 0))
