"""Closed-loop load from client threads: each thread sends one request after another (the
next once the answer is in) until the load is stopped, and its answers are counted."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable

import httpx
import openai

from tests.procs import DEADLINE_S

Send = Callable[[httpx.Client], httpx.Response]
"""One request on the thread's own client, its answer read to the end."""


class ClosedLoop:
    """One client thread per ``(label, send)`` of ``loops``, started on entering and stopped
    (then joined, each for up to DEADLINE_S) on leaving. Counts the answers by status
    (``statuses``) and by label and status (``counts``); keeps the start of every non-200
    body that was read and the error of every request that raised (counted as status 0) in
    ``errors``. ``hang_fails``: a thread still running after its join fails the test ("a
    request hung"); ``daemon``: the threads are daemon threads; ``max_requests``: all threads
    together send no more than this many requests (None: until stopped)."""

    def __init__(
        self,
        loops: Iterable[tuple[str, Send]],
        *,
        daemon: bool = False,
        hang_fails: bool = False,
        max_requests: int | None = None,
    ) -> None:
        self.statuses: Counter[int] = Counter()
        self.counts: Counter[tuple[str, int]] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._hang_fails = hang_fails
        self._budget = max_requests
        self._threads = [
            threading.Thread(target=self._run, args=(label, send), daemon=daemon)
            for label, send in loops
        ]

    def __enter__(self) -> ClosedLoop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=DEADLINE_S)
            if self._hang_fails:
                assert not thread.is_alive(), "a request hung"

    def served(self) -> int:
        """Answers so far, of any status."""
        with self._lock:
            return self.statuses.total()

    def _take_one(self) -> bool:
        """Whether the budget allows one more request (and count it against it)."""
        with self._lock:
            if self._budget is None:
                return True
            self._budget -= 1
            return self._budget >= 0

    def _run(self, label: str, send: Send) -> None:
        with httpx.Client(timeout=DEADLINE_S) as client:
            while not self._stop.is_set() and self._take_one():
                try:
                    answer = send(client)
                except httpx.HTTPError as error:  # counted as status 0, and the load goes on
                    with self._lock:
                        self.statuses[0] += 1
                        self.counts[(label, 0)] += 1
                        self.errors.append(f"{label}: {error!r}")
                    continue
                with self._lock:
                    self.statuses[answer.status_code] += 1
                    self.counts[(label, answer.status_code)] += 1
                    if answer.status_code != 200:
                        try:
                            self.errors.append(answer.text[:200])
                        except httpx.ResponseNotRead:  # a stream, read line by line
                            self.errors.append(f"{answer.status_code} (a stream)")


def openai_embeddings(url: str, model: str, without_retry_after: list[str] | None = None) -> Send:
    """One embedding request through the ``openai`` client on the thread's own connection
    pool. No retries: one call is one request, so the gateway must count exactly as many. A
    refusal (429, 503) that has no Retry-After is noted in ``without_retry_after``."""
    clients: dict[int, openai.OpenAI] = {}

    def send(http: httpx.Client) -> httpx.Response:
        client = clients.get(id(http))
        if client is None:
            client = clients[id(http)] = openai.OpenAI(
                base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http
            )
        try:
            raw = client.embeddings.with_raw_response.create(model=model, input="tide")
        except openai.APIStatusError as exc:
            unexplained = "retry-after" not in exc.response.headers
            if exc.status_code in (429, 503) and unexplained and without_retry_after is not None:
                without_retry_after.append(f"{exc.status_code}: {exc.message}")
            return exc.response
        except openai.APIConnectionError as exc:  # a timeout too: counted as status 0
            raise httpx.TransportError(f"{type(exc).__name__}: {exc}") from exc
        assert len(raw.parse().data) == 1
        return raw.http_response

    return send
