"""The gateway's OpenAPI document: every request body, the X-Priority header, every error."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest
import pytest_asyncio

from tidegate import wire
from tidegate.config import parse_config
from tidegate.errors import InvalidRequest
from tidegate.gateway.app import Gateway, create_gateway_app

ERRORS = ("400", "401", "403", "404", "413", "429", "503", "504")
PATHS = {
    "/v1/embeddings": "EmbeddingsRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
}
MSG = [{"role": "user", "content": "hi"}]


def _gateway() -> Gateway:
    data = {
        "models": [
            {"name": "emb", "task": "embeddings", "engine": "openai", "upstreams": ["http://a"]},
            {"name": "gen", "task": "generate", "engine": "openai", "upstreams": ["http://b"]},
        ]
    }
    config = parse_config(data, "<test>")
    return Gateway(config, replicas={name: [] for name in config.models})


@pytest_asyncio.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    # No lifespan: serving the document needs no dispatcher.
    transport = httpx.ASGITransport(app=create_gateway_app(_gateway()))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


@pytest_asyncio.fixture
async def document(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()  # type: ignore[no-any-return]


@pytest.mark.asyncio
async def test_every_endpoint_documents_its_body_the_priority_header_and_its_errors(
    document: dict[str, Any],
) -> None:
    for path, schema_name in PATHS.items():
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]
        assert body["required"] is True
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{schema_name}"
        (header,) = [p for p in operation["parameters"] if p["name"] == "X-Priority"]
        assert header["in"] == "header"
        assert header["schema"]["enum"] == ["high", "medium", "low", "0", "1", "2"]
        for status in ERRORS:
            response = operation["responses"][status]
            error_ref = response["content"]["application/json"]["schema"]["$ref"]
            assert error_ref == "#/components/schemas/ErrorBody", (path, status)
        for status in ("429", "503"):
            assert "Retry-After" in operation["responses"][status]["headers"]
        assert "application/json" in operation["responses"]["200"]["content"]
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert "text/event-stream" in chat
    error = document["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


@pytest.mark.asyncio
async def test_request_schemas_carry_their_bounds_and_this_gateways_models(
    document: dict[str, Any],
) -> None:
    schemas = document["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["model"]["enum"] == ["gen"]
    assert schemas["EmbeddingsRequest"]["properties"]["model"]["enum"] == ["emb"]
    (max_tokens, _) = chat["max_tokens"]["anyOf"]
    assert (max_tokens["type"], max_tokens["minimum"]) == ("integer", 1)
    assert max_tokens["maximum"] == wire.MAX_OUTPUT_TOKENS
    assert (chat["temperature"]["minimum"], chat["temperature"]["maximum"]) == (0, 2)
    assert chat["stream"]["type"] == "boolean"
    assert chat["messages"]["maxItems"] == wire.MAX_MESSAGES
    names, index, _ = chat["priority"]["anyOf"]
    assert names["enum"] == ["high", "medium", "low"]
    assert (index["minimum"], index["maximum"]) == (0, 2)


@pytest.mark.parametrize(
    ("schema_name", "body", "valid"),
    [
        ("ChatCompletionRequest", {"model": "gen", "messages": MSG}, True),
        ("ChatCompletionRequest", {"model": "gen", "messages": MSG, "priority": "low"}, True),
        ("ChatCompletionRequest", {"model": "gen", "messages": 5}, False),
        ("ChatCompletionRequest", {"model": "gen", "messages": MSG, "max_tokens": True}, False),
        ("ChatCompletionRequest", {"model": "gen", "messages": MSG, "stream": "yes"}, False),
        ("ChatCompletionRequest", {"model": "gen", "messages": MSG, "n": 2}, False),
        ("CompletionRequest", {"model": "gen", "prompt": "a", "max_tokens": -5}, False),
        ("CompletionRequest", {"model": "gen", "prompt": ["a", "b"]}, False),
        ("EmbeddingsRequest", {"model": "emb", "input": ["a", "b"]}, True),
        ("EmbeddingsRequest", {"model": "emb", "input": [[1, 2], [3]]}, True),
        ("EmbeddingsRequest", {"model": "emb", "input": ""}, False),
        ("EmbeddingsRequest", {"model": "emb", "input": ["a", ""]}, False),
    ],
)
@pytest.mark.asyncio
async def test_the_document_and_the_validation_agree(
    document: dict[str, Any], schema_name: str, body: dict[str, Any], valid: bool
) -> None:
    root = {"$ref": f"#/components/schemas/{schema_name}", "components": document["components"]}
    validator = jsonschema.Draft202012Validator(root)
    assert validator.is_valid(body) is valid
    model = next(m for m in wire.REQUEST_OF_PATH.values() if m.__name__ == schema_name)
    try:
        wire.parse(model, body)
        parsed = True
    except InvalidRequest:
        parsed = False
    assert parsed is valid


@pytest.mark.asyncio
async def test_metrics_are_documented_and_served_as_text(
    client: httpx.AsyncClient, document: dict[str, Any]
) -> None:
    content = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"]
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")


@pytest.mark.asyncio
async def test_a_bad_query_parameter_is_the_documented_400_not_fastapis_422(
    client: httpx.AsyncClient, document: dict[str, Any]
) -> None:
    responses = document["paths"]["/admin/defrag"]["post"]["responses"]
    assert "422" not in responses
    assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorBody")
    response = await client.post("/admin/defrag", params={"force": "maybe"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "force")
