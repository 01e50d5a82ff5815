"""Key roles on a real tidegate serve: /admin/* needs an admin key, /metrics what the config
says, and every 401 says how to authenticate (WWW-Authenticate: Bearer)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.gateway.test_upstreams import FakeUpstream
from tests.procs import DEADLINE_S, Proc, gateway_process
from tidegate.control.explain import fetch_autoscaler

ADMIN_KEY = "sk-test-ops"
USER_KEY = "sk-test-batch"
NO_KEY: dict[str, str] = {}
BAD_KEY = {"Authorization": "Bearer sk-test-wrong"}
USER = {"Authorization": f"Bearer {USER_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@contextlib.contextmanager
def keyed_gateway(tmp_path: Path, metrics_auth: str) -> Iterator[Proc]:
    """A gateway with an admin key and a low-capped user key, over one fake upstream."""
    with FakeUpstream() as upstream:
        model = {"name": "emb", "task": "embeddings", "engine": "openai"}
        config = {
            "gateway": {"metrics_auth": metrics_auth},
            "models": [{**model, "upstreams": [upstream.url]}],
            "keys": [
                {"name": "ops", "sha256": _sha(ADMIN_KEY), "role": "admin"},
                {
                    "name": "batch",
                    "sha256": _sha(USER_KEY),
                    "max_priority": "low",
                    "default_priority": "low",
                },
            ],
        }
        path = tmp_path / "tidegate.yaml"
        path.write_text(yaml.safe_dump(config))
        with gateway_process("--config", str(path)) as gateway:
            yield gateway


def get(gateway: Proc, path: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.get(f"{gateway.url}{path}", headers=headers, timeout=DEADLINE_S)


def assert_unauthorized(answer: httpx.Response) -> None:
    assert answer.status_code == 401, answer.text
    assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    assert answer.json()["error"]["type"] == "authentication_error"


def assert_forbidden(answer: httpx.Response) -> None:
    assert answer.status_code == 403, answer.text
    error = answer.json()["error"]
    assert error["type"] == "permission_error"
    assert error["code"] == "admin_required"
    assert "role admin" in error["message"]


def test_admin_api_needs_an_admin_key(tmp_path: Path) -> None:
    with keyed_gateway(tmp_path, "open") as gateway:
        for path in ("/admin/replicas", "/admin/autoscaler", "/admin/defrag"):
            assert_unauthorized(get(gateway, path, NO_KEY))
            assert_unauthorized(get(gateway, path, BAD_KEY))
            assert_forbidden(get(gateway, path, USER))
        defrag = f"{gateway.url}/admin/defrag?force=true"
        forced = httpx.post(defrag, headers=USER, timeout=DEADLINE_S)
        replicas = get(gateway, "/admin/replicas", ADMIN)
        autoscaler = fetch_autoscaler(gateway.url, ADMIN_KEY)  # what `tidegate explain` asks
        with pytest.raises(httpx.HTTPStatusError) as refused:
            fetch_autoscaler(gateway.url, USER_KEY)
        # The user key still does what it is for, within its cap.
        served = httpx.post(
            f"{gateway.url}/v1/embeddings",
            json={"model": "emb", "input": "x"},
            headers=USER,
            timeout=DEADLINE_S,
        )
        anonymous = httpx.post(
            f"{gateway.url}/v1/embeddings", json={"model": "emb", "input": "x"}, timeout=DEADLINE_S
        )
    assert_forbidden(forced)
    assert replicas.status_code == 200
    assert [r["id"] for r in replicas.json()["emb"]["replicas"]] == ["emb-0"]
    assert autoscaler == {"models": {}, "note": "no model is autoscaled in this configuration"}
    assert refused.value.response.status_code == 403
    assert served.status_code == 200, served.text
    assert_unauthorized(anonymous)


@pytest.mark.parametrize(
    ("metrics_auth", "expected"),
    [
        ("open", {"none": 200, "bad": 200, "user": 200, "admin": 200}),
        ("key", {"none": 401, "bad": 401, "user": 200, "admin": 200}),
        ("admin", {"none": 401, "bad": 401, "user": 403, "admin": 200}),
    ],
)
def test_metrics_access_follows_metrics_auth(
    tmp_path: Path, metrics_auth: str, expected: dict[str, int]
) -> None:
    callers = {"none": NO_KEY, "bad": BAD_KEY, "user": USER, "admin": ADMIN}
    with keyed_gateway(tmp_path, metrics_auth) as gateway:
        answers = {who: get(gateway, "/metrics", headers) for who, headers in callers.items()}
    assert {who: a.status_code for who, a in answers.items()} == expected
    for answer in answers.values():
        if answer.status_code == 401:
            assert_unauthorized(answer)
        elif answer.status_code == 200:
            assert "tidegate_requests_total" in answer.text
