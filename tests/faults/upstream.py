"""A scriptable OpenAI-compatible upstream for the fault suite: a real process on loopback.

``python -m tests.faults.upstream --mode MODE`` prints its URL on the first line, then serves
``/health`` (always 200: only the traffic shows the fault) and the three OpenAI endpoints:

* ``ok``: a small valid answer (streams send three chunks, then ``[DONE]``);
* ``fail``: 500 to every request;
* ``die-mid-stream``: a stream sends two chunks, then the process exits at once (as if
  killed: no last chunk, no ``[DONE]``); non-streaming requests are answered normally.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket

from aiohttp import web


def _chunk(text: str) -> bytes:
    payload = {
        "id": "cmpl-fault",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "up",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def make_app(mode: str) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if mode == "fail":
            return web.json_response({"error": {"message": "upstream broke"}}, status=500)
        if mode == "die-before-answer":
            os._exit(17)  # a crash mid-request: the connection closes without a byte
        if body.get("stream") is True:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(_chunk("a"))
            await response.write(_chunk("b"))
            if mode == "die-mid-stream":
                await asyncio.sleep(0.05)  # let the two chunks leave the socket buffer
                os._exit(17)
            await response.write(_chunk("c"))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        if request.path.endswith("/embeddings"):
            vector = {"object": "embedding", "index": 0, "embedding": [0.0]}
            return web.json_response({"object": "list", "data": [vector]})
        return web.json_response(
            {
                "id": "cmpl-fault",
                "object": "chat.completion",
                "created": 0,
                "model": "up",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    app = web.Application()
    app.router.add_get("/health", health)
    for path in ("/v1/embeddings", "/v1/completions", "/v1/chat/completions"):
        app.router.add_post(path, answer)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode", choices=["ok", "fail", "die-mid-stream", "die-before-answer"], default="ok"
    )
    args = parser.parse_args()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    web.run_app(make_app(args.mode), sock=sock, print=None, handle_signals=True)


if __name__ == "__main__":
    main()
