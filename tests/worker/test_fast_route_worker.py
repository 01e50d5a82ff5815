"""``POST /v1/embeddings`` as ``tidegate worker`` serves it: off the HTTP protocol, not ASGI
(``worker.app.fast_routes``). A real worker process, raw sockets: the answers and errors
are the ASGI route's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import flat_profile, sim_worker
from tests.gateway.test_fast_route import read_response, request
from tests.procs import DEADLINE_S, Proc, wait_for
from tests.rawhttp import connect

EMBED = json.dumps({"model": "sim", "input": ["tide", "gate"]}).encode()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    folder: Path = tmp_path_factory.mktemp("worker-fast")
    with sim_worker(flat_profile(folder / "sim.json", 1.0)) as proc:
        yield proc


def test_embeddings_and_errors_on_one_kept_alive_connection(worker: Proc) -> None:
    with connect(worker.url) as sock:
        buffer = bytearray()
        sock.sendall(request(EMBED) + request(EMBED))  # pipelined
        for _ in range(2):
            status, headers, body = read_response(sock, buffer)
            assert status == 200
            assert headers["content-type"] == "application/json"
            answer = json.loads(body)
            assert [item["index"] for item in answer["data"]] == [0, 1]
            assert answer["usage"]["prompt_tokens"] > 0
        cases = [
            (request(b"{"), 400, None),
            (request(b'{"model": "other", "input": "x"}'), 404, "model_not_found"),
            (request(EMBED, b"/v1/embeddings", b"X-Tidegate-Priority: urgent"), 400, None),
        ]
        for raw, status_wanted, code in cases:
            sock.sendall(raw)
            status, _, body = read_response(sock, buffer)
            assert status == status_wanted
            error = json.loads(body)["error"]
            assert error["message"]
            if code is not None:
                assert error["code"] == code


def test_the_fast_route_is_counted_like_the_asgi_one(worker: Proc) -> None:
    def completed() -> float:
        text = httpx.get(f"{worker.url}/metrics", timeout=DEADLINE_S).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("tidegate_requests_total{") and 'outcome="completed"' in line
        )

    before = completed()
    with connect(worker.url) as sock:
        sock.sendall(request(EMBED))
        assert read_response(sock, bytearray())[0] == 200
    wait_for(lambda: completed() == before + 1)
