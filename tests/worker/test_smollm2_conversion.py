"""A worker killed while it converts SmolLM2 leaves nothing a later start would trust.

The real thing, once: ``tidegate worker --model smollm2`` with an empty cache converts the
GGUF file and is killed (SIGKILL) while it writes the converted weights. A second start on
the same cache must not load that half-written folder: it removes it and converts again
(it is killed too once that is seen: a whole conversion takes a minute, and finishing one
after a killed one is covered with a fake converter in tests/engines/test_model_folder.py).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.procs import Proc, wait_for, worker_process
from tidegate.engines import model_folder, smollm2

CONVERSION_S = 900.0  # a minute on a busy 2-core machine


def scratch_folders(cache: Path) -> set[Path]:
    return set(cache.glob("models/gguf/.tmp-*"))


def kill(worker: Proc) -> None:
    os.killpg(worker.process.pid, signal.SIGKILL)
    worker.process.wait(timeout=30)


def test_a_worker_killed_mid_conversion_leaves_no_folder_a_later_start_trusts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIDEGATE_CACHE", str(tmp_path))  # the workers' environment
    folder = model_folder.converted_folder(smollm2.gguf_path(), tmp_path)

    with worker_process("--model", smollm2.NAME, wait_ready=False) as first:
        wait_for(
            lambda: any((p / "model.safetensors").exists() for p in scratch_folders(tmp_path)),
            timeout_s=CONVERSION_S,
            interval_s=0.01,
        )
        kill(first)
    assert not folder.exists(), "the conversion finished before the kill: nothing was tested"
    (half,) = scratch_folders(tmp_path)
    assert not model_folder.is_complete(half)

    with worker_process("--model", smollm2.NAME, wait_ready=False) as second:
        # It takes the lock the dead worker held, removes its leftovers, converts anew.
        wait_for(lambda: scratch_folders(tmp_path) - {half}, timeout_s=CONVERSION_S)
        assert not half.exists()
        assert second.process.poll() is None
        kill(second)
    assert not folder.exists()
