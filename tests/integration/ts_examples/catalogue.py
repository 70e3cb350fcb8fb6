"""The archives each server pair serves and the calls sent to each, known before anything is built.

Static, so pytest can name every call at collection without making a model. Three pairs:
`service_envelope` is a server-wide key of config.properties, so the json and kservev2
envelopes each get their own stock TorchServe and Mariner.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.integration.ts_examples import builders as b
from tests.integration.ts_examples.examples import Example, Req, png

JSON = "application/json"
TEXT = "text/plain"
FOUR = json.dumps([[1.0, 2.0, 3.0, 4.0]]).encode()
DIGIT = png((28, 28), "L")
PHOTO = png((40, 30), "RGB")
JSON_BODY = json.dumps({"instances": [[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 1.0]]}).encode()
KSERVE_V2_BODY = json.dumps(
    {
        "id": "dropin-1",
        "inputs": [
            {
                "name": "input-0",
                "shape": [2, 4],
                "datatype": "FP32",
                "data": [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 1.0],
            }
        ],
    }
).encode()

MAIN: tuple[Example, ...] = (
    Example(
        "mnist",
        "mnist.mar",
        b.build_mnist,
        (Req("png", DIGIT, grpc=True), Req("explain-png", DIGIT, endpoint="explanations")),
        needs=("torchvision", "captum"),
    ),
    Example(
        "base_builtin", "base_builtin.mar", b.build_base_handler, (Req("json-rows", FOUR, JSON, grpc=True),)
    ),
    Example(
        "image_builtin",
        "image_builtin.mar",
        b.build_image_classifier,
        (Req("png", PHOTO, grpc=True), Req("explain-png", PHOTO, endpoint="explanations")),
        needs=("torchvision", "captum"),
    ),
    Example(
        "text_builtin",
        "text_builtin.mar",
        b.build_text_classifier,
        (
            Req("text", b"a good movie", TEXT, grpc=True),
            Req("explain-text", b"a bad movie", TEXT, endpoint="explanations"),
        ),
        needs=("captum",),
    ),
    Example(
        "module_handle", "module_handle.mar", b.build_handle_module, (Req("csv", b"1,2,3", TEXT, grpc=True),)
    ),
    Example(
        "custom_fn",
        "custom_fn.mar",
        b.build_custom_function,
        (Req("echo-header", b"hello", TEXT, headers=(("X-Dropin", "yes"),), grpc=True),),
    ),
    Example(
        "errors",
        "errors.mar",
        b.build_errors,
        (
            Req("fine", b"fine", TEXT, grpc=True),
            Req("prediction-exception-513", b"custom", TEXT, grpc=True),
            Req("value-error", b"value", TEXT, grpc=True),
        ),
    ),
    Example("with_config", "with_config.mar", b.build_model_config, (Req("yaml", b"x", TEXT, grpc=True),)),
    Example(
        "with_deps",
        "with_deps.mar",
        b.build_deps,
        (
            Req("shout", b"quiet", TEXT, grpc=True),
            Req("json-object", b'{"a": 1}', JSON, grpc=True),
            Req("octets", b"\x01abc", "application/octet-stream"),
            Req("no-content-type", b"plain words"),
        ),
    ),
    Example("onnx_linear", "onnx_linear.mar", b.build_onnx, (Req("json-rows", FOUR, JSON, grpc=True),)),
    Example(
        "plain_dir", "plain_dir", b.build_no_archive, (Req("shout", b"from a dir", TEXT),), startup=False
    ),
    Example(
        "plain_tgz", "plain_tgz.tar.gz", b.build_tgz, (Req("shout", b"from a tgz", TEXT),), startup=False
    ),
)

ENVELOPED: dict[str, tuple[Example, ...]] = {
    "json": (
        Example(
            "enveloped",
            "enveloped.mar",
            b.build_envelope_handler,
            (Req("instances", JSON_BODY, JSON, grpc=True),),
        ),
        Example(
            "base_builtin",
            "base_builtin.mar",
            b.build_base_handler,
            (Req("instances", JSON_BODY, JSON, grpc=True),),
        ),
    ),
    "kservev2": (
        Example(
            "enveloped",
            "enveloped.mar",
            b.build_envelope_handler,
            (Req("v2-inputs", KSERVE_V2_BODY, JSON, grpc=True),),
        ),
        Example(
            "base_builtin",
            "base_builtin.mar",
            b.build_base_handler,
            (Req("v2-inputs", KSERVE_V2_BODY, JSON),),
        ),
    ),
}

PAIRS: dict[str, tuple[Example, ...]] = {"plain": MAIN, **ENVELOPED}


def build_store(pair: str, store: Path, work: Path) -> tuple[Example, ...]:
    """Build every archive of `pair` into a fresh `store` (staging under `work`)."""
    if store.exists():
        shutil.rmtree(store)
    store.mkdir(parents=True)
    for example in PAIRS[pair]:
        example.build(store, work)
    return PAIRS[pair]
