"""The GGUF conversion cache, with a fake converter: real processes, real locks, real kills.

The converter is the only fake (it writes a few bytes instead of a model), so these run in
a second; the real conversion of SmolLM2 killed mid-way is in tests/worker/test_smollm2.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import DEADLINE_S, child_env, wait_for
from tidegate.engines.model_folder import (
    MARKER,
    converted_folder,
    ensure_converted,
    is_complete,
    local_model_folder,
)

REPO = Path(__file__).resolve().parents[2]


def fake_convert(gguf: Path, out: Path) -> None:
    """Writes a folder as the real converter does, logging each call next to the file."""
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(gguf.read_bytes() * 2)
    with (gguf.parent / "conversions.log").open("a") as log:
        log.write(f"{os.getpid()}\n")
    time.sleep(float(os.environ.get("FAKE_CONVERT_SLEEP_S", "0")))
    if os.environ.get("FAKE_CONVERT_HANG"):
        (out / "half-written").write_bytes(b"x")
        time.sleep(3600)


def conversions(gguf: Path) -> int:
    log = gguf.parent / "conversions.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "Tiny-Model.Q4_1.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF fake weights")
    return path


def convert_in_child(gguf: Path, cache: Path, **env: str) -> subprocess.Popen[str]:
    code = (
        "import sys; from pathlib import Path;"
        "from tidegate.engines.model_folder import ensure_converted;"
        "from tests.engines.test_model_folder import fake_convert;"
        "print(ensure_converted(Path(sys.argv[1]), Path(sys.argv[2]), fake_convert), flush=True)"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, str(gguf), str(cache)],
        cwd=REPO,
        env={**child_env(), **env},
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_folder_is_used_as_it_is(tmp_path: Path) -> None:
    assert local_model_folder(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("name", ["missing", "weights.bin"])
def test_a_path_that_is_neither_folder_nor_gguf_is_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    if name != "missing":
        path.write_bytes(b"x")
    with pytest.raises((FileNotFoundError, ValueError), match=str(path)):
        local_model_folder(path, tmp_path / "cache")


def test_a_gguf_file_converts_once_then_loads_from_the_cache(gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = ensure_converted(gguf, cache, fake_convert)
    assert folder == converted_folder(gguf, cache)
    assert folder.parent == cache / "models" / "gguf"
    assert is_complete(folder)
    assert (folder / "model.safetensors").read_bytes() == gguf.read_bytes() * 2
    assert ensure_converted(gguf, cache, fake_convert) == folder
    assert conversions(gguf) == 1
    # The same bytes elsewhere (another virtual environment) share the conversion.
    copy = tmp_path / "other-venv" / gguf.name
    copy.parent.mkdir()
    copy.write_bytes(gguf.read_bytes())
    assert ensure_converted(copy, cache, fake_convert) == folder
    assert conversions(gguf) == 1


def test_changed_weights_convert_again(gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = ensure_converted(gguf, cache, fake_convert)
    gguf.write_bytes(b"GGUF other weights")
    second = ensure_converted(gguf, cache, fake_convert)
    assert second != first
    assert conversions(gguf) == 2


def test_a_folder_without_its_marker_is_never_trusted(gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = converted_folder(gguf, cache)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"half")
    assert ensure_converted(gguf, cache, fake_convert) == folder
    assert conversions(gguf) == 1
    assert (folder / "model.safetensors").read_bytes() == gguf.read_bytes() * 2
    assert (folder / MARKER).is_file()


def test_two_processes_starting_at_once_convert_once(gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    children = [convert_in_child(gguf, cache, FAKE_CONVERT_SLEEP_S="1") for _ in range(2)]
    outputs = [child.communicate(timeout=DEADLINE_S)[0].strip() for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert outputs == [str(converted_folder(gguf, cache))] * 2
    assert conversions(gguf) == 1


def test_a_conversion_killed_midway_leaves_nothing_a_later_start_trusts(
    gguf: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    folder = converted_folder(gguf, cache)
    child = convert_in_child(gguf, cache, FAKE_CONVERT_HANG="1")
    try:
        wait_for(lambda: any(folder.parent.glob("*/half-written")), timeout_s=DEADLINE_S)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.communicate(timeout=DEADLINE_S)
    assert child.returncode == -signal.SIGKILL
    assert not folder.exists()  # only a scratch folder, under another name
    (scratch,) = [p for p in folder.parent.iterdir() if p.is_dir()]
    assert not is_complete(scratch)
    # The next start takes the lock the dead process held, clears its leftovers, converts.
    assert ensure_converted(gguf, cache, fake_convert) == folder
    assert is_complete(folder)
    assert not scratch.exists()
    assert conversions(gguf) == 2
