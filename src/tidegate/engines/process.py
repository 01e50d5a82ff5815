"""An embedding engine in a process of its own, as vLLM's engine core.

Why: in one process the worker's event loop (HTTP, JSON, token counting) and torch's
forward pass share the GIL, and batches ran 1.2 to 1.8x slower in the worker than called
directly (docs/benchmarks.md, "Worker batching"). Here the worker keeps only a tokenizer to
count tokens (it needs the answer before queueing); a child process builds the engine with
the same ``build`` call (``registry.build_engine``), loads it and runs one batch at a time.

Wire: a socket pair, framed by ``multiprocessing.connection`` (a length prefix per frame).

- worker -> child: pickles: first the ``build`` callable, then ``(EMBED, id, texts)`` or
  ``(MEMORY, id, None)``; ``None`` asks the child to stop.
- child -> worker: one frame per answer, a header (kind, id, rows, columns) and a body:
  the float32 rows of a batch (the parent wraps them in a numpy array without a copy),
  the text of a batch's error, or a pickle (the card and memory after loading, a memory
  report).

Invariants:

- The child never outlives the worker: it exits when its end of the socket reads EOF,
  however the worker went. It ignores SIGINT and SIGTERM sent to the worker's process
  group, so that the worker shuts down first and then stops it (``close``).
- A batch that raises in the child fails that batch only.
- The child's death (killed, crashed, socket closed) fails every pending batch with
  ``ReplicaFailed``, refuses every later one, and calls the ``on_failure`` callbacks once.
  Closing the engine is not a failure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tidegate.engines.base import Engine, FailureNotice, MemoryReport, ModelCard, Vectors
from tidegate.engines.hf_runtime import peak_rss_bytes
from tidegate.errors import ConfigError, ReplicaFailed

log = logging.getLogger("tidegate.engine")

EMBED, MEMORY = "embed", "memory"  # worker -> child requests
READY, VECTORS, ERROR, REPORT = range(4)  # child -> worker answers
_HEADER = struct.Struct("<BQII")  # kind, request id, rows, columns
STOP_TIMEOUT_S = 10.0  # close() waits this long for the child's own exit, then kills it
MEMORY_TIMEOUT_S = 10.0  # memory() waits this long for the child, then reports what it had
# Where the engine runs when the settings do not say: the worker's process for now. On this
# 2-CPU machine bench_worker.py measured no gain from the engine process (docs/benchmarks.md,
# "Worker batching"): the loss there is CPU contention between the HTTP loop and torch's
# threads, not the GIL. Turn one on here once a benchmark shows it wins.
DEFAULT_ENGINE_PROCESS = {"transformers": False, "simulated": False}


def wants_engine_process(requested: bool | None, card: ModelCard) -> bool:
    """Whether a worker runs this engine in a process of its own (``engine_process``).

    Raises ConfigError when it is asked for a generation model: those run in the worker.
    """
    if requested is False:
        return False
    if card.task != "embeddings":
        if requested:
            raise ConfigError(
                "<command line>",
                "engine_process",
                f"model {card.name!r} generates text: only embedding engines run in a "
                "process of their own",
                "leave --engine-process out (or give --no-engine-process)",
            )
        return False
    return requested or DEFAULT_ENGINE_PROCESS.get(card.engine, False)


@runtime_checkable
class Counting(Protocol):
    """What the worker's side needs: the card and token counts, with no weights loaded."""

    card: ModelCard

    def load_counter(self) -> None: ...

    def count_tokens(self, texts: Sequence[str]) -> list[int]: ...


@runtime_checkable
class Blocking(Protocol):
    """What the child runs: an engine whose batches block the calling thread."""

    card: ModelCard

    def load(self) -> None: ...

    def embed_sync(self, texts: list[str]) -> Vectors: ...

    def memory(self) -> MemoryReport: ...

    def close(self) -> None: ...


class ProcessEmbeddingEngine:
    """An ``EmbeddingEngine`` whose model runs in a child process built by ``build()``.

    ``local`` is an unloaded ``build()`` of the worker's own: it counts tokens (it loads
    only its tokenizer) and gives the card until the child has loaded.
    """

    def __init__(
        self,
        build: Callable[[], Engine],
        local: Counting,
        *,
        stop_timeout_s: float = STOP_TIMEOUT_S,
    ) -> None:
        self._build = build
        self._local = local
        self.card = local.card
        self.stop_timeout_s = stop_timeout_s
        self._memory = MemoryReport(device="cpu", weights_bytes=0, peak_bytes=0)
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()  # one frame at a time on the socket
        self._lock = threading.Lock()  # the fields below
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._ids = itertools.count()
        self._notice = FailureNotice(self.card.name)
        self._failure: str | None = None  # why the child died (refuses new batches); set once
        self._closing = False

    @property
    def pid(self) -> int | None:
        """The child's process id, once started."""
        return None if self._process is None else self._process.pid

    # ------------------------------------------------------------------ life
    def load(self) -> None:
        """Start the child and wait until it has loaded the model (or failed to)."""
        self._local.load_counter()
        ours, theirs = socket.socketpair()
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), _log_level()],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # the worker's stdout carries its address
            )
        self._conn = Connection(ours.detach())
        try:
            self._conn.send(self._build)
            kind, _, _, body = _receive(self._conn)
        except (EOFError, OSError) as exc:
            self._stop_child()
            raise RuntimeError(f"the engine process {self._exit_reason()} while loading") from exc
        if kind != READY:
            self._stop_child()
            raise RuntimeError(f"the engine process failed to load: {bytes(body).decode()}")
        self.card, self._memory = pickle.loads(body)
        self._reader = threading.Thread(
            target=self._read, name=f"engine-process-{self.card.name}", daemon=True
        )
        self._reader.start()

    def close(self) -> None:
        """Stop the child cleanly (killed after ``stop_timeout_s``); fail what is pending."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            pending, self._pending = self._pending, {}
        _fail_all(pending, ReplicaFailed(f"engine {self.card.name}: the engine was closed"))
        self._stop_child()
        if self._reader is not None:
            self._reader.join(self.stop_timeout_s)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self._notice.subscribe(callback)

    # ------------------------------------------------------------------ requests
    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return self._local.count_tokens(texts)

    async def embed(self, texts: Sequence[str]) -> Vectors:
        vectors: Vectors = await asyncio.wrap_future(self._request(EMBED, list(texts)))
        return vectors

    def memory(self) -> MemoryReport:
        """The child's report; on CPU its peak plus this process's (an upper bound)."""
        if self._failure is None and not self._closing and self._conn is not None:
            future = self._request(MEMORY, None)
            try:
                self._memory = future.result(MEMORY_TIMEOUT_S)
            except (concurrent.futures.TimeoutError, ReplicaFailed) as exc:
                log.warning("engine %s: no memory report from its process: %s", self.card.name, exc)
        report = self._memory
        if report.device == "cpu" and self.card.engine != "simulated":
            # The replica is both processes: the model's and this one's HTTP server and
            # tokenizer. (A simulated engine's figures are its profile's, not measured.)
            report = dataclasses.replace(report, peak_bytes=report.peak_bytes + peak_rss_bytes())
        return report

    def _request(self, kind: str, payload: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._failure is not None:
                raise ReplicaFailed(self._failure)
            if self._closing or self._conn is None:
                raise ReplicaFailed(f"engine {self.card.name}: the engine is not running")
            ident = next(self._ids)
            self._pending[ident] = future
            conn = self._conn
        try:
            # On the caller's thread: the child reads as soon as it is idle, and the worker
            # sends one batch at a time, so this write does not wait on a batch.
            with self._send_lock:
                conn.send((kind, ident, payload))
        except OSError as exc:  # the child is gone: the reader fails the rest
            with self._lock:
                self._pending.pop(ident, None)
            raise ReplicaFailed(f"engine {self.card.name}: its process is gone") from exc
        return future

    # ------------------------------------------------------------------ the reader thread
    def _read(self) -> None:
        """Settle each answer's future, until the child's socket closes."""
        assert self._conn is not None
        try:
            while True:
                kind, ident, shape, body = _receive(self._conn)
                with self._lock:
                    future = self._pending.pop(ident, None)
                if future is None:
                    continue  # closed meanwhile
                if kind == VECTORS:  # a view of the frame: no copy
                    _settle(future, np.frombuffer(body, dtype=np.float32).reshape(shape))
                elif kind == REPORT:
                    _settle(future, pickle.loads(body))
                else:
                    _settle(future, exc=RuntimeError(f"engine process: {bytes(body).decode()}"))
        except (EOFError, OSError):
            self._ended()

    def _ended(self) -> None:
        """The child's socket closed: a failure, unless the worker is closing the engine."""
        reason = f"engine {self.card.name}: its engine process {self._exit_reason()}"
        with self._lock:  # with the swap: a batch is either failed here or refused
            pending, self._pending = self._pending, {}
            died = not self._closing and self._failure is None
            if died:
                self._failure = reason
        if not died:
            _fail_all(pending, ReplicaFailed(f"engine {self.card.name}: the engine was closed"))
            return
        _fail_all(pending, ReplicaFailed(reason))
        self._notice.announce(reason)

    # ------------------------------------------------------------------ the child process
    def _stop_child(self) -> None:
        """Ask the child to stop, wait for it, kill it if it lingers; close the socket last."""
        if self._conn is not None:
            try:
                with self._send_lock:
                    self._conn.send(None)
            except OSError:
                pass  # gone already
        if self._process is not None:
            try:
                self._process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("engine %s: its process did not stop; killing it", self.card.name)
                self._process.kill()
                self._process.wait()
        if self._reader is not None:
            self._reader.join(self.stop_timeout_s)  # it reads EOF now that the child is gone
        if self._conn is not None:
            self._conn.close()

    def _exit_reason(self) -> str:
        """How the child ended: its exit status or signal, once it is gone."""
        assert self._process is not None
        try:
            code = self._process.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            return f"(pid {self._process.pid}) closed its socket"
        if code < 0:
            return f"(pid {self._process.pid}) was killed by {signal.Signals(-code).name}"
        return f"(pid {self._process.pid}) exited with status {code}"


def _settle(
    future: concurrent.futures.Future[Any], result: Any = None, exc: BaseException | None = None
) -> None:
    if not future.set_running_or_notify_cancel():
        return  # its caller went away
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _fail_all(pending: dict[int, concurrent.futures.Future[Any]], exc: BaseException) -> None:
    for future in pending.values():
        _settle(future, exc=exc)


def _receive(conn: Connection) -> tuple[int, int, tuple[int, int], memoryview]:
    """One answer: kind, request id, (rows, columns) of vectors, body."""
    frame = memoryview(conn.recv_bytes())
    kind, ident, rows, columns = _HEADER.unpack_from(frame)
    return kind, ident, (rows, columns), frame[_HEADER.size :]


def _log_level() -> str:
    return logging.getLevelName(logging.getLogger("tidegate").getEffectiveLevel())


# --------------------------------------------------------------------------- child side
def _answer(
    conn: Connection, kind: int, ident: int, body: bytes, shape: tuple[int, ...] = (0, 0)
) -> None:
    conn.send_bytes(_HEADER.pack(kind, ident, *shape) + body)


def serve(conn: Connection) -> int:
    """The child's loop: build and load, then answer one request at a time until EOF."""
    try:
        build = conn.recv()
    except EOFError:
        return 0  # the worker went before it asked for anything
    try:
        engine = build()
        if not isinstance(engine, Blocking):
            raise TypeError(f"{type(engine).__name__} cannot run in an engine process")
        engine.load()
        loaded = pickle.dumps((engine.card, engine.memory()))
    except Exception as exc:
        log.exception("engine process: loading failed")
        _answer(conn, ERROR, 0, f"{type(exc).__name__}: {exc}".encode())
        return 1
    _answer(conn, READY, 0, loaded)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return 0  # the worker is gone, however it went: so are we
        if message is None:
            engine.close()
            return 0
        kind, ident, texts = message
        if kind == MEMORY:
            _answer(conn, REPORT, ident, pickle.dumps(engine.memory()))
            continue
        try:
            vectors = np.ascontiguousarray(engine.embed_sync(texts), dtype=np.float32)
        except Exception as exc:  # this batch failed, not the engine
            log.exception("engine %s failed a batch of %d", engine.card.name, len(texts))
            _answer(conn, ERROR, ident, f"{type(exc).__name__}: {exc}".encode())
            continue
        _answer(conn, VECTORS, ident, vectors.tobytes(), vectors.shape)


def main(argv: Sequence[str]) -> int:
    """``python -m tidegate.engines.process FD LEVEL``: the child, on socket FD."""
    fd, level = int(argv[0]), argv[1]
    # The worker's process group gets these (Ctrl-C, a supervisor's SIGTERM); the worker
    # answers them and then closes us. Dying first would look like an engine failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    conn = Connection(fd)
    try:
        return serve(conn)
    except OSError:
        return 0  # the worker closed its end while we answered: it is gone
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
