"""A model path becomes a local Hugging Face folder: used as is, or converted once from GGUF.

``model_path`` is either a folder (``config.json``, weights, tokenizer files) or a ``.gguf``
file. transformers can load a GGUF file itself, but slowly (it parses the whole metadata
and dequantizes every tensor in Python: about a minute for a 100 MB file on a busy 2-core
machine), so a GGUF file is converted once into a folder of float32 safetensors and
tokenizer files under ``$TIDEGATE_CACHE/models/gguf/`` and every later start loads that
folder (seconds).

Invariants of the conversion cache:

- A folder is keyed by the GGUF file's content (SHA-256): the same file installed in two
  virtual environments converts once per machine; a changed file converts again.
- A folder is trusted only when complete: ``MARKER`` is written last, after every other
  file is flushed to disk, and the folder appears under its final name only by one atomic
  ``rename`` of a scratch folder. A conversion killed at any point leaves at most a scratch
  folder, which no load ever reads; the next conversion removes it.
- One conversion per file at a time: an exclusive ``fcntl.flock`` on ``<key>.lock``. A
  second process starting meanwhile waits on the lock, then finds the folder complete and
  loads it. The kernel releases the lock of a killed process, so nothing waits forever on
  a dead converter.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tidegate.engines.hf_runtime import quiet_transformers
from tidegate.engines.tiny_llama import default_cache_dir

log = logging.getLogger(__name__)

MARKER = "tidegate-converted.json"  # written last: its presence means the folder is complete
FORMAT = 1  # bump when the conversion changes what it writes: old folders are then ignored
_SCRATCH = ".tmp-"  # prefix of a conversion's scratch folder


def local_model_folder(model_path: str | Path, cache_dir: Path | None = None) -> Path:
    """The folder to load ``model_path`` from: itself, or its GGUF conversion (made once)."""
    path = Path(model_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ensure_converted(path, cache_dir)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    raise ValueError(f"model path {path} is neither a Hugging Face model folder nor a .gguf file")


def converted_folder(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Where the conversion of ``gguf`` lives (complete or not)."""
    root = (cache_dir if cache_dir is not None else default_cache_dir()) / "models" / "gguf"
    return root / f"{_safe_stem(gguf)}-{file_digest(gguf)[:16]}-v{FORMAT}"


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def ensure_converted(
    gguf: Path,
    cache_dir: Path | None = None,
    convert: Callable[[Path, Path], None] | None = None,
) -> Path:
    """The complete conversion of ``gguf``, made now if no process has made it yet.

    ``convert(gguf, out)`` writes the folder ``out`` (default ``convert_gguf``); tests pass
    a fake one to exercise the cache without a model.
    """
    folder = converted_folder(gguf, cache_dir)
    if is_complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder.with_name(folder.name + ".lock")):
        if is_complete(folder):  # another process converted it while this one waited
            return folder
        _remove_leftovers(folder)
        scratch = folder.with_name(f"{_SCRATCH}{folder.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        started = time.monotonic()
        log.warning("converting %s once into %s (this takes a minute)", gguf, folder)
        try:
            (convert or convert_gguf)(gguf, scratch)
            _write_marker(scratch, gguf)
            scratch.rename(folder)  # atomic: the folder appears complete, or not at all
            _fsync_dir(folder.parent)
        finally:
            if scratch.exists():
                shutil.rmtree(scratch, ignore_errors=True)
        log.warning("converted %s in %.1fs", gguf.name, time.monotonic() - started)
    return folder


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` through transformers and write it as a local model folder."""
    import torch
    import transformers

    hf: Any = transformers  # its functions are untyped
    quiet_transformers()
    out.mkdir(parents=True)
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = hf.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = hf.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # The weights are plain float32 tensors now; what is left of the quantizer only stops
    # save_pretrained, and the saved config must not ask the next load for a GGUF file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


@functools.lru_cache(maxsize=16)
def _digest(path: Path, size: int, mtime_ns: int) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of the file's bytes; computed once per process while the file is unchanged."""
    stat = path.stat()
    return _digest(path.resolve(), stat.st_size, stat.st_mtime_ns)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released by close, or by the process's death
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(folder: Path) -> None:
    """Under the lock: scratch folders of killed conversions, and a folder without MARKER."""
    for stale in folder.parent.glob(f"{_SCRATCH}{folder.name}-*"):
        log.warning("removing %s, left by a conversion that did not finish", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if folder.exists():  # not complete (checked by the caller): never trusted, replaced
        log.warning("removing %s: it has no %s, so it is not complete", folder, MARKER)
        shutil.rmtree(folder, ignore_errors=True)


def _write_marker(folder: Path, gguf: Path) -> None:
    """Flush every file, then write the marker and flush it: the marker is last on disk too."""
    for path in folder.iterdir():
        if path.is_file():
            with path.open("rb") as file:
                os.fsync(file.fileno())
    marker = folder / MARKER
    with marker.open("w") as file:
        json.dump({"source": str(gguf), "sha256": file_digest(gguf), "format": FORMAT}, file)
        file.flush()
        os.fsync(file.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _safe_stem(path: Path) -> str:
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)
    return stem[:64] or "model"


__all__ = [
    "MARKER",
    "convert_gguf",
    "converted_folder",
    "ensure_converted",
    "file_digest",
    "is_complete",
    "local_model_folder",
]
