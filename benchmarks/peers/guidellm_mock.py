"""An upstream of bench_gateway.py that nobody here wrote: guidellm's mock server.

Runs with the Python of a separate virtual environment that has guidellm (never the
project's own: guidellm pins its own transformers and pulls torch). Install the CPU torch
first, or pip resolves guidellm's torch to a CUDA build of several GB:

    python3.11 -m venv /tmp/guidellm-venv
    /tmp/guidellm-venv/bin/pip install torch==2.13.0
    /tmp/guidellm-venv/bin/pip install guidellm
    /tmp/guidellm-venv/bin/python benchmarks/peers/guidellm_mock.py --port 8124

This is ``guidellm mock-server`` (the same ``MockServer`` and ``MockServerConfig`` its CLI
builds; Sanic, one process, on 127.0.0.1), with two differences from the CLI: Sanic's access
log is off (the CLI always logs every request to stdout, which would cost the upstream CPU
per request and fill the pipe the benchmark reads the address from), and the first line on
stdout is the base URL, printed once the server listens; everything else it writes goes to
stderr. It serves ``/health``, ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses``, ``/tokenize`` and ``/detokenize``; no embeddings. The latencies default to
zero (``--ttft-ms 0 --itl-ms 0``) so that it answers at once: a non-streamed chat completion
of ``min(--output-tokens, max_tokens)`` made-up tokens, counted by guidellm's mock tokenizer
(no model is loaded). SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="mock")
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--output-tokens", type=int, default=8)
    args = parser.parse_args()

    # The address goes to the real stdout; Sanic's own lines (it logs to stdout) to stderr.
    address = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    from guidellm.mock_server.server import MockServer
    from guidellm.schemas.mock_server import MockServerConfig

    config = MockServerConfig(
        host="127.0.0.1",
        port=args.port,
        model=args.model,
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        output_tokens=args.output_tokens,
    )
    server = MockServer(config)

    async def listening(app: object) -> None:
        print(f"http://127.0.0.1:{args.port}", file=address, flush=True)

    server.app.register_listener(listening, "after_server_start")
    server.run(access_log=False)
    sys.exit(0)


if __name__ == "__main__":
    main()
