"""`OPTIONS /` and `GET /api-description` describe, as an OpenAPI 3 document, exactly the routes
an app serves: generated from the Starlette app, so a route added anywhere is described."""

from __future__ import annotations

from typing import Any

import pytest
import requests
from openapi_spec_validator import validate
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.common.http_common import json_response, make_app
from mariner.server.common.openapi import api_description_routes, openapi_document
from mariner.server.frontend.protocols.http_listener import inference_app
from mariner.server.supervisor.management.http import management_app
from tests.unit.fakes import FakePlane, serve

pytestmark = pytest.mark.unit
TIMEOUT = 30


def fetch(base: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The document both ways TorchServe serves it; they must be the same document."""
    via_options = requests.options(f"{base}/", timeout=TIMEOUT)
    via_get = requests.get(f"{base}/api-description", timeout=TIMEOUT)
    assert via_options.status_code == via_get.status_code == 200
    assert via_options.json() == via_get.json()
    return via_options.json(), via_get.json()


def test_management_port_describes_its_routes_with_methods_params_and_docstrings() -> None:
    with serve(management_app(FakePlane())) as base:  # type: ignore[arg-type]
        doc, _ = fetch(base)
    validate(doc)
    assert doc["openapi"] == "3.0.1"  # what TorchServe 0.12 declares
    assert set(doc["info"]) >= {"title", "version", "description"}
    paths = doc["paths"]
    assert set(paths) >= {
        "/",
        "/api-description",
        "/models",
        "/models/{name}",
        "/models/{name}/{version}",
        "/models/{name}/{version}/set-default",
    }
    assert set(paths["/models"]) == {"get", "post"}
    assert set(paths["/models/{name}/{version}"]) == {"get", "put", "delete"}
    assert set(paths["/models/{name}/{version}/set-default"]) == {"put"}
    assert set(paths["/"]) == {"options"}
    params = paths["/models/{name}/{version}"]["delete"]["parameters"]
    assert [(p["name"], p["in"], p["required"]) for p in params] == [
        ("name", "path", True),
        ("version", "path", True),
    ]
    # Summaries are the endpoints' docstrings (through the error guard that wraps them).
    assert paths["/models"]["get"]["summary"] == "List the models served (their default versions), paginated."
    assert paths["/models/{name}"]["put"]["summary"].startswith("Set a model version's worker count")


def test_inference_port_describes_every_protocol_it_serves() -> None:
    with serve(inference_app(FakePlane())) as base:  # type: ignore[arg-type]
        doc, _ = fetch(base)
    validate(doc)
    paths = doc["paths"]
    assert set(paths["/predictions/{model}/{version}"]) == {"post", "put"}
    assert [p["name"] for p in paths["/predictions/{model}/{version}"]["post"]["parameters"]] == [
        "model",
        "version",
    ]
    assert set(paths["/v2/models/{model}/infer"]) == {"post"}
    assert not any("{rest}" in p for p in paths)  # the /v2 catch-all shapes errors; not an operation
    assert {"/ping", "/api-description", "/"} <= set(paths)
    assert "/models" not in paths  # management routes are the management port's
    for item in paths.values():
        for op in item.values():
            assert op["summary"]  # every operation says what it does, at least by its route


def test_a_route_added_to_an_app_is_described_without_any_list_kept() -> None:
    async def shout(request: Request) -> Response:
        """Answer loudly.

        The rest of the docstring becomes the description."""
        return json_response({"ok": True})

    app = make_app([Route("/shout/{times:int}", shout, methods=["POST"]), *api_description_routes("t")])
    doc = openapi_document(app.routes, "t")
    validate(doc)
    op = doc["paths"]["/shout/{times}"]["post"]
    assert op["summary"] == "Answer loudly."
    assert "description" in op
    assert op["parameters"] == [
        {"name": "times", "in": "path", "required": True, "schema": {"type": "integer"}}
    ]
    assert "head" not in doc["paths"]["/api-description"]  # Starlette's implicit HEAD is not ours
