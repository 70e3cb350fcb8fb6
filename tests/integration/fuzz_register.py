"""Hostile model registrations for test_fuzz.py: every parameter of REST `POST /models` (query
string or JSON body) and gRPC RegisterModel, and the model name and version of the management
routes, drawn from what has broken servers before.

A register parameter reaches the model store as a path (`url`), worker ids and the workers'
plain-text log lines (`model_name`) and the settings (`batch_size`, ...): a NUL in `url` once
answered 500 with a traceback, a newline in `model_name` forged log lines, `a/b` registered a
model no URL could unregister. So the strategies lean on control characters (C0, DEL, C1, the
Unicode line separators), path tricks (`..`, `/`, `\\`, `%2F`, absolute paths, URLs), names the
archiver's rule refuses, and strings past the 128-character name cap and the 4,096-character
parameter cap.

A drawn case never registers anything: its url is never an archive in the store unless its
model name is one the rule refuses (checked first), so every answer is a refusal and the fuzzed
server serves exactly its one model afterwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import quote

from hypothesis import strategies as st

from mariner.server.contracts.names import control_problem, model_name_problem
from tests.integration.fuzzing import MODEL, VERSION, http_request, mostly

REGISTER_PARAMS = ("url", "model_name", "batch_size", "max_batch_delay", "response_timeout",
                   "initial_workers", "synchronous", "runtime")  # fmt: skip
CONTROLS = tuple(chr(c) for c in (*range(0x20), 0x7F, 0x85, 0x9B)) + ("\u2028", "\u2029")
PATH_TRICKS = ("../../etc/x", "..", ".", "/", "a/b", "a\\b", "/etc/passwd", "..%2F..%2Fetc", "%2e%2e",
               "~root", "C:\\x", "file:///etc/passwd", "http://127.0.0.1/x.mar", "s3://b/x.mar",
               f"{MODEL}.mar/..", f"./{MODEL}.mar", "MAR-INF/MANIFEST.json")  # fmt: skip
ODD_NAMES = ("", "-x", ".x", "_x", "a b", "caf\u00e9", "\u202ex", "\U0001f600", "a:b", "a;b", "a*", "a?",
             "a#b", "a%00b", "con", "all")  # fmt: skip
MISSING = "no-such-archive.mar"


@st.composite
def with_controls(draw: st.DrawFn, base: st.SearchStrategy[str]) -> str:
    """`base` with one to three control characters put anywhere in it."""
    text = draw(base)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(CONTROLS)) + text[at:]
    return text


plain_text = st.one_of(st.sampled_from(ODD_NAMES + PATH_TRICKS), st.text(max_size=24))
hostile_text = mostly(
    st.one_of(plain_text, with_controls(plain_text), with_controls(st.just(MODEL))),
    st.one_of(  # long: past the name cap, the parameter cap, a path component's NAME_MAX
        st.integers(129, 300).map(lambda n: "n" * n),
        st.integers(4090, 4200).map(lambda n: "u" * n),
        st.integers(250, 600).map(lambda n: "d" * n + ".mar"),
    ),
)
urls = st.one_of(st.just(MISSING), st.sampled_from(PATH_TRICKS), hostile_text).filter(
    lambda u: u not in (f"{MODEL}.mar", f"./{MODEL}.mar", MODEL)
)


@dataclass(frozen=True)
class RegisterCase:
    """One hostile registration: its parameters in order, sent as a query string or a JSON body."""

    params: tuple[tuple[str, str], ...]
    as_json: bool

    @property
    def values(self) -> dict[str, str]:
        return dict(self.params)

    @property
    def invalid_name(self) -> bool:
        name = self.values.get("model_name", "")
        return bool(name) and model_name_problem(name) is not None

    @property
    def has_control(self) -> bool:
        return any(control_problem(v) for v in self.values.values())

    def wire(self) -> bytes:
        if self.as_json:
            body = json.dumps(self.values).encode()
            return http_request(
                "POST", "/models", headers=[(b"content-type", b"application/json")], body=body
            )
        query = "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in self.params)
        return http_request("POST", "/models?" + query)


@st.composite
def register_cases(draw: st.DrawFn) -> RegisterCase:
    name = draw(st.one_of(hostile_text, st.just("fine-name")))
    refused = bool(name) and model_name_problem(name) is not None  # "" means no name given
    url = draw(st.one_of(urls, st.just(f"{MODEL}.mar"))) if refused else draw(urls)
    params = {"url": url, "model_name": name}
    for key in draw(st.lists(st.sampled_from(REGISTER_PARAMS[2:]), max_size=3, unique=True)):
        params[key] = draw(st.one_of(st.sampled_from(["1", "0", "-1", "true", "python"]), hostile_text))
    return RegisterCase(tuple(params.items()), draw(st.booleans()))


@dataclass(frozen=True)
class RouteCase:
    """A management call on `/models/{name}[/{version}]` with hostile path parameters."""

    method: str
    name: str
    version: str | None

    @property
    def routed(self) -> bool:
        """Whether the path reaches a route at all: an empty segment or a `/` (sent as %2F, decoded
        before routing) makes it another path, which is a 404."""
        parts = [self.name] if self.version is None else [self.name, self.version]
        return all(p and "/" not in p for p in parts)

    def wire(self) -> bytes:
        path = "/models/" + quote(self.name, safe="")
        if self.version is not None:
            path += "/" + quote(self.version, safe="")
        return http_request(self.method, path)


route_cases = st.builds(
    RouteCase,
    method=st.sampled_from(["GET", "PUT", "DELETE"]),
    name=st.one_of(hostile_text, st.just(MODEL)),
    version=st.one_of(st.none(), st.just(VERSION), hostile_text),
).filter(lambda c: c.method == "GET" or c.name != MODEL)  # never unregister or scale the fuzzed model


def grpc_register_fields(case: RegisterCase) -> dict[str, object]:
    """The case as RegisterModelRequest fields (its numbers only where they parse as one)."""
    fields: dict[str, object] = {"url": case.values["url"], "model_name": case.values.get("model_name", "")}
    for key in ("batch_size", "max_batch_delay", "response_timeout", "initial_workers"):
        value = case.values.get(key)
        if value is not None and value.lstrip("-").isdigit() and abs(int(value)) < 2**31:
            fields[key] = int(value)
    if "runtime" in case.values:
        fields["runtime"] = case.values["runtime"]
    return fields
