"""The OpenAPI document is true: it lists what each route answers, and a property-based fuzzer
(schemathesis, bounded) finds no 5xx and no response the document does not describe.

The server runs a ScriptedEngine (the real admission checks, scripted tokens), so the fuzzer
spends its time on HTTP, not on compiling model steps."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from scripted_engine import ScriptedEngine
from server_harness import MODEL, running_server

FUZZ_EXAMPLES = 200
GUARDED_FUZZ_EXAMPLES = 40
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, negative_data_rejection]


@pytest.fixture(scope="module")
def server(tiny_model_factory, model_cache_dir):
    with running_server(tiny_model_factory, model_cache_dir, engine_class=ScriptedEngine) as srv:
        yield srv


@pytest.fixture(scope="module")
def document(server) -> dict:
    return server.http.get("/openapi.json").json()


def test_every_route_documents_what_it_answers(document):
    paths = document["paths"]
    statuses = {(path, method): sorted(op["responses"]) for path, item in paths.items() for method, op in item.items()}
    with_body = ["200", "400", "404", "413", "415", "500", "503"]
    assert statuses == {("/health", "get"): ["200", "500", "503"], ("/v1/models", "get"): ["200", "500"],
                        ("/v1/models/{model_id}", "get"): ["200", "404", "500"], ("/version", "get"): ["200", "500"],
                        ("/metrics", "get"): ["200", "500"], ("/v1/completions", "post"): with_body,
                        ("/v1/chat/completions", "post"): with_body, ("/tokenize", "post"): with_body,
                        ("/detokenize", "post"): with_body}
    schemas = document["components"]["schemas"]
    for (path, method), codes in statuses.items():
        op = paths[path][method]
        for code in codes:
            assert op["responses"][code]["headers"]["X-Request-Id"]["required"] is True
            if code != "200":
                assert op["responses"][code]["content"] == {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    for path, body in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        op = paths[path]["post"]
        assert sorted(op["responses"]["200"]["content"]) == ["application/json", "text/event-stream"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{body}"
        assert schemas[body]["properties"]["model"]["enum"] == [MODEL, "alias"]
    n = schemas["CompletionRequest"]["properties"]["n"]["anyOf"][0]
    assert (n["minimum"], n["maximum"]) == (1, 128)
    assert set(schemas["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}


def fuzz(url: str, examples: int) -> list[int]:
    """Schema-valid and schema-violating requests to every route (a fixed, bounded sample),
    each answered as the document says; the statuses they got."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    statuses = []

    @given(case=cases)
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        statuses.append(case.call_and_validate(checks=CHECKS, timeout=30).status_code)

    run()
    return statuses


def test_fuzzed_requests_get_documented_answers(server):
    fuzz(server.url, FUZZ_EXAMPLES)


def test_with_an_api_key_fuzzed_requests_without_it_get_documented_401s(tiny_model_factory, model_cache_dir):
    with running_server(tiny_model_factory, model_cache_dir, engine_class=ScriptedEngine, api_key="sk-k") as srv:
        statuses = fuzz(srv.url, GUARDED_FUZZ_EXAMPLES)
    assert 401 in statuses and 200 in statuses  # the protected routes refuse, the open ones answer
