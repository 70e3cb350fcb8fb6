"""Every call the drop-in suite sends, in order, named before any server starts.

Per pair: /ping and gRPC Ping; for the plain pair the registrations made at start-up (url= of
each archive not loaded by load_models); the model list; describe of every archive; each
archive's requests over REST and, where the catalogue says, TorchServe's gRPC Predictions; then
the management calls that change state (scale, unregister) and the errors TorchServe users
meet (unknown model, conflict, missing file), last so they disturb nothing before them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tests.integration.ts_examples.calls import TIMEOUT_S, Answer, grpc_manage, grpc_ping, grpc_predict, http
from tests.integration.ts_examples.catalogue import PAIRS
from tests.integration.ts_examples.examples import Example, Req
from tests.integration.ts_examples.servers import Endpoint, Pair

Run = Callable[[Endpoint, Pair], Answer]
SCALE_WAIT_S = 60.0


@dataclass(frozen=True)
class Call:
    pair: str
    archive: str
    label: str  # what is sent, as a TorchServe user would write it
    run: Run
    describe: bool = False

    @property
    def id(self) -> str:
        return f"{self.pair}:{self.archive}:{self.label}"


def _rest(
    method: str,
    path: str,
    *,
    management: bool = False,
    body: bytes | None = None,
    content_type: str | None = None,
    headers: tuple[tuple[str, str], ...] = (),
    params: dict[str, str] | None = None,
) -> Run:
    def run(ep: Endpoint, pair: Pair) -> Answer:
        base = ep.management if management else ep.http
        timeout = TIMEOUT_S if management else pair.timeout_for(path.rsplit("/", 1)[-1])
        return http(
            method,
            base + path,
            body=body,
            content_type=content_type,
            headers=headers,
            params=params,
            timeout=timeout,
        )

    return run


def _predict_grpc(model: str, body: bytes) -> Run:
    return lambda ep, pair: grpc_predict(ep.grpc, model, body, timeout=pair.timeout_for(model))


def _manage(method: str, request: str, **fields: str | int) -> Run:
    return lambda ep, _: grpc_manage(ep.grpc_management, method, request, **fields)


def _registered(name: str) -> Run:
    return lambda ep, pair: pair.registrations[name][0 if ep.title == "TorchServe" else 1]


def _describe_when_scaled(model: str, workers: int) -> Run:
    """Describe once the model shows `workers` READY workers (or SCALE_WAIT_S passed): scaling is
    asynchronous on both servers, and the answer compared is the settled one."""

    def run(ep: Endpoint, _: Pair) -> Answer:
        end = time.monotonic() + SCALE_WAIT_S
        while True:
            answer = http("GET", f"{ep.management}/models/{model}")
            try:
                states = [w.get("status") for v in json.loads(answer.body) for w in v.get("workers", [])]
            except (ValueError, TypeError, AttributeError):
                states = []
            if states.count("READY") >= workers or time.monotonic() > end:
                return answer
            time.sleep(0.5)

    return run


BURST = 4  # with_config's batchSize: requests sent at once, to see how they are batched


def _burst(model: str) -> Run:
    """BURST requests at once; the answer lists the statuses and bodies, sorted (order-free).

    with_config says batchSize 4, maxBatchDelay 1000 ms (long, so that on a loaded machine the four
    still arrive inside the window) and its handler answers how many rows its
    batch had, so this shows whether a server waits to fill a batch as TorchServe does.
    """

    def run(ep: Endpoint, pair: Pair) -> Answer:
        one = lambda i: http("POST", f"{ep.http}/predictions/{model}", body=b"x", content_type="text/plain")  # noqa: E731
        with ThreadPoolExecutor(max_workers=BURST) as pool:
            answers = list(pool.map(one, range(BURST)))
        statuses = ",".join(sorted(a.status for a in answers))
        bodies = sorted(json.dumps(_json_or_text(a.body), sort_keys=True) for a in answers)
        return Answer(statuses, json.dumps([json.loads(b) for b in bodies]).encode())

    return run


def _json_or_text(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace")


def _request_calls(pair: str, e: Example, req: Req) -> list[Call]:
    path = f"/{req.endpoint}/{e.name}"
    shown = f"POST {path} ({req.label}{', ' + req.content_type if req.content_type else ''})"
    calls = [
        Call(
            pair,
            e.name,
            shown,
            _rest("POST", path, body=req.body, content_type=req.content_type, headers=req.headers),
        )
    ]
    if req.grpc:
        calls.append(Call(pair, e.name, f"gRPC Predictions ({req.label})", _predict_grpc(e.name, req.body)))
    return calls


def pair_calls(pair: str) -> list[Call]:
    examples = PAIRS[pair]
    calls = [
        Call(pair, "-", "GET /ping", _rest("GET", "/ping")),
        Call(pair, "-", "gRPC Ping", lambda ep, _: grpc_ping(ep.grpc)),
    ]
    for e in examples:
        if not e.at_startup:  # registered by url= when not loaded at start-up (Example docs)
            calls.append(
                Call(pair, e.name, f"POST /models?url={e.url}&initial_workers=1", _registered(e.name))
            )
    calls.append(Call(pair, "-", "GET /models", _rest("GET", "/models", management=True)))
    for e in examples:
        calls.append(
            Call(
                pair,
                e.name,
                f"GET /models/{e.name}",
                _rest("GET", f"/models/{e.name}", management=True),
                describe=True,
            )
        )
    for e in examples:
        for req in e.requests:
            calls += _request_calls(pair, e, req)
    if pair == "plain":
        calls.append(
            Call(
                pair,
                "with_config",
                f"{BURST} concurrent POST /predictions/with_config",
                _burst("with_config"),
            )
        )
        calls += management_calls(pair)
    return calls


def management_calls(pair: str) -> list[Call]:
    m = lambda method, path, **kw: _rest(method, path, management=True, **kw)  # noqa: E731
    return [
        Call(
            pair,
            "with_config",
            "GET /models/with_config/2.0",
            m("GET", "/models/with_config/2.0"),
            describe=True,
        ),
        Call(pair, "with_config", "GET /models/with_config/9.9", m("GET", "/models/with_config/9.9")),
        Call(pair, "-", "GET /models/nope", m("GET", "/models/nope")),
        Call(
            pair,
            "-",
            "POST /predictions/nope",
            _rest("POST", "/predictions/nope", body=b"x", content_type="text/plain"),
        ),
        Call(pair, "-", "gRPC Predictions (nope)", _predict_grpc("nope", b"x")),
        Call(
            pair,
            "errors",
            "POST /models?url=errors.mar (conflict)",
            m("POST", "/models", params={"url": "errors.mar"}),
        ),
        Call(pair, "-", "POST /models?url=missing.mar", m("POST", "/models", params={"url": "missing.mar"})),
        Call(
            pair,
            "errors_idle",
            "POST /models?url=errors.mar&model_name=errors_idle&initial_workers=0",
            m(
                "POST",
                "/models",
                params={"url": "errors.mar", "model_name": "errors_idle", "initial_workers": "0"},
            ),
        ),
        Call(pair, "errors_idle", "GET /models/errors_idle", m("GET", "/models/errors_idle"), describe=True),
        Call(
            pair,
            "errors_idle",
            "POST /predictions/errors_idle (no worker)",
            _rest("POST", "/predictions/errors_idle", body=b"fine", content_type="text/plain"),
        ),
        Call(
            pair,
            "errors",
            "PUT /models/errors?min_worker=2",
            m("PUT", "/models/errors", params={"min_worker": "2"}),
        ),
        Call(
            pair,
            "errors",
            "GET /models/errors (after scale)",
            _describe_when_scaled("errors", 2),
            describe=True,
        ),
        Call(pair, "with_deps", "DELETE /models/with_deps", m("DELETE", "/models/with_deps")),
        Call(
            pair,
            "with_deps",
            "POST /predictions/with_deps (after unregister)",
            _rest("POST", "/predictions/with_deps", body=b"x", content_type="text/plain"),
        ),
        Call(pair, "-", "DELETE /models/nope", m("DELETE", "/models/nope")),
        Call(
            pair,
            "with_config",
            "POST /predictions/with_config/2.0",
            _rest("POST", "/predictions/with_config/2.0", body=b"x", content_type="text/plain"),
        ),
        Call(pair, "-", "GET /models?limit=2", m("GET", "/models", params={"limit": "2"})),
        Call(pair, "-", "gRPC ListModels", _manage("ListModels", "ListModelsRequest")),
        Call(pair, "-", "gRPC ListModels (limit=100)", _manage("ListModels", "ListModelsRequest", limit=100)),
        Call(
            pair,
            "errors",
            "gRPC DescribeModel",
            _manage("DescribeModel", "DescribeModelRequest", model_name="errors"),
            describe=True,
        ),
        Call(
            pair,
            "-",
            "gRPC DescribeModel (nope)",
            _manage("DescribeModel", "DescribeModelRequest", model_name="nope"),
        ),
        Call(
            pair,
            "with_config",
            "PUT /models/with_config/2.0/set-default",
            m("PUT", "/models/with_config/2.0/set-default"),
        ),
        Call(pair, "with_config", "DELETE /models/with_config/2.0", m("DELETE", "/models/with_config/2.0")),
    ]


ALL_CALLS: tuple[Call, ...] = tuple(c for pair in PAIRS for c in pair_calls(pair))
