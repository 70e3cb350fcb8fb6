"""The digits handler: input decoding, per-item errors in a batch, config checks, no `ts`.

Runs on a model dir staged in tmp_path from a freshly initialised DigitsCNN, so no built
archives are needed.
"""

from __future__ import annotations

import inspect
import io
import json
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

import mariner.handlers.digits_handler as dh
from mariner.handlers.digits_handler import DigitsHandler, decode_item
from mariner.server.worker.context import Context
from mariner.training.model import DigitsCNN

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MODEL_KWARGS = {"width": 8, "hidden": 32, "dropout": 0.25}
NORM = {"mean": 4.9, "std": 6.0}
WEIGHTS = "weights.pt"


# -- fixtures -----------------------------------------------------------------------------


def _manifest(serialized: str = WEIGHTS) -> dict[str, Any]:
    return {
        "model": {
            "modelName": "digits_test",
            "serializedFile": serialized,
            "handler": "digits_handler.py",
            "modelVersion": "1.0",
        }
    }


def _config(fmt: str = "eager", **extra: Any) -> dict[str, Any]:
    return {"batchSize": 4, "handler": {"format": fmt, "model_kwargs": MODEL_KWARGS, **extra}}


def _context(model_dir: Path, config: dict[str, Any], manifest: dict[str, Any] | None = None) -> Context:
    return Context(
        "digits_test",
        str(model_dir),
        manifest or _manifest(),
        batch_size=int(config.get("batchSize", 1)),
        gpu_id=None,
        model_yaml_config=config,
    )


@pytest.fixture(scope="module")
def reference_model() -> DigitsCNN:
    torch.manual_seed(1234)
    return DigitsCNN(**MODEL_KWARGS).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, reference_model: DigitsCNN) -> Path:
    """What an eager archive unpacks to: weights, model definition, norm and labels."""
    d = tmp_path_factory.mktemp("staged")
    torch.save(reference_model.state_dict(), d / WEIGHTS)
    shutil.copy2(ROOT / "training" / "model.py", d / "digits_model.py")
    (d / "norm.json").write_text(json.dumps(NORM))
    (d / "labels.json").write_text(json.dumps([str(i) for i in range(10)]))
    return d


@pytest.fixture(scope="module")
def handler(model_dir: Path) -> DigitsHandler:
    h = DigitsHandler()
    h.initialize(_context(model_dir, _config()))
    return h


@pytest.fixture
def ctx(model_dir: Path) -> Context:
    return _context(model_dir, _config())


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    d = load_digits()
    return d.data.astype(np.float32), d.target


def _handle(h: DigitsHandler, ctx: Context, batch: list[Any]) -> list[Any]:
    """What a runner does: reset the per-request context, then call handle()."""
    ctx.begin_batch([f"req-{i}" for i in range(len(batch))], [{} for _ in batch])
    out = h.handle(batch, ctx)
    assert len(out) == len(batch)
    return out


# -- images -------------------------------------------------------------------------------


def _digit_image(pixels: np.ndarray, *, scale: int = 4, dark_on_light: bool = False) -> Image.Image:
    """An 8x8 0..16 digit blown up to a (8*scale)^2 grayscale picture."""
    img = np.kron(pixels.reshape(8, 8), np.ones((scale, scale))) * (255.0 / 16.0)
    if dark_on_light:
        img = 255.0 - img
    return Image.fromarray(np.round(img).astype(np.uint8), mode="L")


def _encode(img: Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])


@pytest.fixture(scope="module")
def clean_digits(digits: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray]:
    """A few digits (different classes) with a mostly blank border, like a real scan."""
    x, y = digits
    picked: dict[int, np.ndarray] = {}
    for row, label in zip(x, y, strict=True):
        img = row.reshape(8, 8)
        border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
        if label not in picked and border.mean() <= 2.0:
            picked[int(label)] = row
        if len(picked) == 4:
            break
    assert len(picked) == 4
    return list(picked.values())


# -- decode_item: accepted inputs -----------------------------------------------------------


@pytest.fixture(scope="module")
def sample(digits: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    return digits[0][42]


def _accepted_forms(px: np.ndarray) -> dict[str, Any]:
    flat = [float(v) for v in px]
    ints = [int(v) for v in px]
    nested = px.reshape(8, 8).tolist()
    return {
        "flat list of floats": flat,
        "flat list of ints": ints,
        "8x8 nested list": nested,
        "json bytes": json.dumps(flat).encode(),
        "json bytearray": bytearray(json.dumps(ints).encode()),
        "json str": json.dumps(nested),
        "json object bytes": json.dumps({"data": flat}).encode(),
        "dict with data": {"data": flat},
        "dict with body bytes": {"body": json.dumps(flat).encode()},
        "dict with nested data object": {"data": {"data": nested}},
        "numpy flat": px.copy(),
        "numpy 8x8 float64": px.reshape(8, 8).astype(np.float64),
        "numpy uint8": px.astype(np.uint8),
        "torch flat": torch.from_numpy(px.copy()),
        "torch 8x8": torch.from_numpy(px.reshape(8, 8).copy()),
    }


@pytest.mark.parametrize("form", list(_accepted_forms(np.zeros(64, dtype=np.float32))))
def test_decode_item_accepts(form: str, sample: np.ndarray) -> None:
    out = decode_item(_accepted_forms(sample)[form])
    assert out.shape == (64,)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, sample)


def test_decode_item_accepts_the_bounds_exactly() -> None:
    px = [0.0] * 32 + [16.0] * 32
    np.testing.assert_array_equal(decode_item(px), np.array(px, dtype=np.float32))


def test_decode_prefers_data_over_body() -> None:
    out = decode_item({"data": [1] * 64, "body": b"not json"})
    assert (out == 1).all()
    out = decode_item({"data": None, "body": json.dumps([2] * 64).encode()})
    assert (out == 2).all()


@pytest.mark.parametrize("dark_on_light", [False, True], ids=["light-on-dark", "dark-on-light"])
def test_decode_png_recovers_the_digit(clean_digits: list[np.ndarray], dark_on_light: bool) -> None:
    for px in clean_digits:
        raw = _encode(_digit_image(px, dark_on_light=dark_on_light), "PNG")
        out = decode_item(raw)
        assert out.shape == (64,)
        assert out.min() >= 0.0
        assert out.max() <= 16.0
        # BOX-downscaling a 4x blow-up is exact up to 8-bit quantisation (16/255 per step).
        np.testing.assert_allclose(out, px, atol=16 / 255 + 1e-4)


@pytest.mark.parametrize("dark_on_light", [False, True], ids=["light-on-dark", "dark-on-light"])
def test_decode_jpeg_correlates_with_the_digit(clean_digits: list[np.ndarray], dark_on_light: bool) -> None:
    for px in clean_digits:
        raw = _encode(_digit_image(px, dark_on_light=dark_on_light), "JPEG", quality=90)
        assert raw.startswith(b"\xff\xd8\xff")
        out = decode_item(raw)
        # Dark ink on light paper is inverted: without that the correlation would be ~ -1.
        assert _corr(out, px) > 0.95
        assert np.abs(out - px).mean() < 1.0


def test_decode_rgb_image_and_image_in_a_request_dict(clean_digits: list[np.ndarray]) -> None:
    px = clean_digits[0]
    rgb = _digit_image(px, scale=3, dark_on_light=True).convert("RGB")
    out = decode_item({"body": _encode(rgb, "PNG")})
    assert _corr(out, px) > 0.95


# -- decode_item: rejected inputs -----------------------------------------------------------


def _png_bytes() -> bytes:
    return _encode(_digit_image(np.arange(64, dtype=np.float32) % 17), "PNG")


REJECTED: dict[str, tuple[Any, str]] = {
    "63 pixels": ([1.0] * 63, r"expected 64 pixels.*63 items"),
    "65 pixels": ([1.0] * 65, r"expected 64 pixels.*65 items"),
    "8 pixels": ([1.0] * 8, r"expected 64 pixels"),
    "empty list": ([], r"expected 64 pixels.*0 items"),
    "8x7": ([[1.0] * 7 for _ in range(8)], r"8x8 nested list.*7 items"),
    "8x8 ragged": ([[1.0] * 8 for _ in range(7)] + [[1.0] * 7], r"8x8 nested list.*7 items"),
    "8 rows of 64": ([[1.0] * 64 for _ in range(8)], r"expected 64 pixels"),
    "7x8 + number": ([[1.0] * 8 for _ in range(7)] + [1.0], r"8x8 nested list"),
    "3-deep": ([[[1.0] * 8] * 8] * 8, r"8x8 nested list"),
    "numpy 7x9": (np.zeros((7, 9), dtype=np.float32), r"expected 64 pixels.*\[7, 9\]"),
    "torch 1x64": (torch.zeros(1, 64), r"expected 64 pixels.*\[1, 64\]"),
    "NaN json": ("[" + ",".join(["NaN"] * 64) + "]", r"finite"),
    "Infinity json": (b"[" + b",".join([b"1"] * 63 + [b"Infinity"]) + b"]", r"finite"),
    "NaN float": ([float("nan")] + [1.0] * 63, r"finite"),
    "-Infinity numpy": (np.full(64, -np.inf, dtype=np.float32), r"finite"),
    "negative": ([-1.0] + [1.0] * 63, r"\[0, 16\].*min -1"),
    "above 16": ([16.5] + [1.0] * 63, r"\[0, 16\].*max 16.5"),
    "255 (raw 8-bit)": ([255] * 64, r"\[0, 16\]"),
    "negative tensor": (-torch.ones(64), r"\[0, 16\]"),
    "strings": (["3"] * 64, r"numbers in \[0, 16\].*str"),
    "one string": ([1.0] * 63 + ["x"], r"numbers in \[0, 16\].*str"),
    "booleans": ([True] * 64, r"numbers in \[0, 16\].*bool"),
    "json booleans": (json.dumps([False] * 64), r"numbers in \[0, 16\].*bool"),
    "nulls": ([None] * 64, r"numbers in \[0, 16\].*NoneType"),
    "json null": (b"null", r"numbers in \[0, 16\]"),
    "data None": ({"data": None}, r"empty request"),
    "None": (None, r"empty request"),
    "json string": ('"1,2,3"', r"numbers in \[0, 16\]"),
    "json number": ("7", r"expected 64 pixels.*shape \[\]"),
    "object without data": (b'{"pixels": [1]}', r"'data' key"),
    "empty body": (b"", r"empty body.*64 pixels"),
    "empty str": ("", r"empty body"),
    "whitespace body": (b"  \n\t ", r"empty body.*64 pixels"),
    "whitespace str": (" \r\n", r"empty body"),
    "invalid json": (b"[1, 2,", r"not valid JSON"),
    "trailing garbage": ("[1] x", r"not valid JSON"),
    "non-utf8 bytes": (b"\x80\x81\xfe\xfdgarbage", r"neither UTF-8 JSON nor a PNG/JPEG"),
    "truncated png": (_png_bytes()[: len(_png_bytes()) // 2], r"image but could not be decoded"),
    "png magic only": (b"\x89PNG\r\n\x1a\n", r"image but could not be decoded"),
    "jpeg magic only": (b"\xff\xd8\xff\xe0garbage", r"image but could not be decoded"),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_decode_item_rejects(case: str) -> None:
    value, message = REJECTED[case]
    with pytest.raises(ValueError, match=message):
        decode_item(value)


# -- handle() -------------------------------------------------------------------------------


def _expected_logits(model: DigitsCNN, pixels: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(np.asarray(pixels, dtype=np.float32)).reshape(-1, 1, 8, 8)
    with torch.inference_mode():
        return model((x - NORM["mean"]) / NORM["std"])


def test_handle_answers_with_the_model_top_k(
    handler: DigitsHandler, ctx: Context, reference_model: DigitsCNN, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    px = digits[0][:6]
    out = _handle(handler, ctx, [{"data": row.tolist()} for row in px])
    probs = torch.softmax(_expected_logits(reference_model, px), dim=1)
    for res, p in zip(out, probs, strict=True):
        assert set(res) == {"label", "topk"}
        assert res["label"] == int(p.argmax())
        assert len(res["topk"]) == 3
        assert res["topk"][0]["label"] == res["label"]
        top_p, top_i = p.topk(3)
        assert [t["label"] for t in res["topk"]] == top_i.tolist()
        for t, want in zip(res["topk"], top_p.tolist(), strict=True):
            assert t["probability"] == pytest.approx(want, abs=1e-6)
        ps = [t["probability"] for t in res["topk"]]
        assert ps == sorted(ps, reverse=True)
    json.dumps(out)  # the result is plain JSON


def test_handle_isolates_a_bad_item_in_a_batch(
    handler: DigitsHandler, ctx: Context, digits: tuple[np.ndarray, np.ndarray]
) -> None:
    x = digits[0]
    good = [
        {"data": x[0].tolist()},
        {"body": json.dumps(x[1].reshape(8, 8).tolist()).encode()},
        {"data": json.dumps(x[2].tolist())},
    ]
    bad = {"body": b"[1, 2, 3]"}
    batch = [good[0], bad, good[1], good[2]]
    out = _handle(handler, ctx, batch)

    assert out[1]["code"] == 400
    assert set(out[1]) == {"error", "code"}
    assert "64 pixels" in out[1]["error"]
    assert ctx.get_response_status(1) == (400, out[1]["error"])
    for i in (0, 2, 3):
        assert ctx.get_response_status(i)[0] == 200
        assert "error" not in out[i]

    alone = [_handle(handler, ctx, [g])[0] for g in good]
    assert [out[0], out[2], out[3]] == alone


def test_handle_keeps_input_order(
    handler: DigitsHandler, ctx: Context, digits: tuple[np.ndarray, Any]
) -> None:
    items = [{"data": row.tolist()} for row in digits[0][10:18]]
    forward = _handle(handler, ctx, items)
    backward = _handle(handler, ctx, items[::-1])
    assert backward == forward[::-1]
    # The results really differ item to item, so the order check above means something.
    assert len({json.dumps(r) for r in forward}) == len(forward)
    alone = [_handle(handler, ctx, [it])[0] for it in items]
    assert forward == alone


def test_handle_with_only_bad_items(handler: DigitsHandler, ctx: Context) -> None:
    out = _handle(handler, ctx, [{"body": b""}, {"data": [99] * 64}])
    assert [r["code"] for r in out] == [400, 400]
    assert "empty body" in out[0]["error"]
    assert "[0, 16]" in out[1]["error"]
    assert ctx.get_response_status(0) == (400, out[0]["error"])
    assert ctx.get_response_status(1) == (400, out[1]["error"])


def test_handle_empty_batch(handler: DigitsHandler, ctx: Context) -> None:
    assert _handle(handler, ctx, []) == []


def test_handle_works_without_set_response_status(handler: DigitsHandler) -> None:
    """A bare context object (no per-request API) still gets per-item errors."""

    class Bare:
        system_properties: dict[str, Any] = {}

    out = handler.handle([{"data": [1] * 64}, {"data": "nope"}], Bare())
    assert "label" in out[0]
    assert out[1]["code"] == 400


def test_handle_accepts_images_in_a_batch(
    handler: DigitsHandler, ctx: Context, clean_digits: list[np.ndarray], reference_model: DigitsCNN
) -> None:
    px = clean_digits[1]
    png = _encode(_digit_image(px, dark_on_light=True), "PNG")
    out = _handle(handler, ctx, [{"body": png}, {"data": px.tolist()}])
    assert out[0]["label"] == out[1]["label"] == int(_expected_logits(reference_model, px).argmax())


def test_huge_integer_pixel_is_a_per_item_400(handler: DigitsHandler, ctx: Context) -> None:
    huge = b"[" + str(10**400).encode() + b"," + b",".join([b"1"] * 63) + b"]"
    out = _handle(handler, ctx, [{"data": [1] * 64}, {"body": huge}])
    assert "label" in out[0]
    assert out[1]["code"] == 400


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_decompression_bomb_png_is_a_per_item_400(handler: DigitsHandler, ctx: Context) -> None:
    bomb = _png_header_only(30000, 30000)
    out = _handle(handler, ctx, [{"data": [1] * 64}, {"body": bomb}])
    assert "label" in out[0]
    assert out[1]["code"] == 400


# -- initialize() ---------------------------------------------------------------------------


def test_initialize_reads_norm_labels_and_topk(model_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (d / "norm.json").write_text(json.dumps({"mean": 1.5, "std": 2.5}))
    (d / "labels.json").write_text(json.dumps(list("abcdefghij")))
    h = DigitsHandler()
    h.initialize(_context(d, _config(topk=5)))
    assert h.initialized
    assert (h.mean, h.std) == (1.5, 2.5)
    assert h.labels == list("abcdefghij")
    assert h.topk == 5
    assert h.device == torch.device("cpu")
    x = h.normalise(np.full((2, 64), 4.0, dtype=np.float32))
    assert x.shape == (2, 1, 8, 8)
    torch.testing.assert_close(x, torch.full((2, 1, 8, 8), (4.0 - 1.5) / 2.5))
    res = h.handle([{"data": [3] * 64}], _context(d, _config()))
    assert len(res[0]["topk"]) == 5


@pytest.mark.parametrize("fmt", ["pickle", "tensorrt", "", None])
def test_unknown_format_is_a_clear_error(model_dir: Path, fmt: str | None) -> None:
    cfg = _config()
    if fmt is None:
        del cfg["handler"]["format"]
    else:
        cfg["handler"]["format"] = fmt
    with pytest.raises(ValueError, match=r"handler\.format must be one of .*eager.*torchscript.*onnx"):
        DigitsHandler().initialize(_context(model_dir, cfg))


def test_handler_section_must_be_a_mapping(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="'handler' section must be a mapping"):
        DigitsHandler().initialize(_context(model_dir, {"handler": "eager"}))


def test_missing_serialized_file_is_a_clear_error(model_dir: Path) -> None:
    manifest = {"model": {"modelName": "digits_test"}}
    with pytest.raises(ValueError, match="serializedFile"):
        DigitsHandler().initialize(_context(model_dir, _config(), manifest))


@pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")
def test_torchscript_format_matches_eager(
    model_dir: Path, tmp_path: Path, reference_model: DigitsCNN, digits: tuple[np.ndarray, Any]
) -> None:
    d = tmp_path / "ts"
    shutil.copytree(model_dir, d)
    torch.jit.script(reference_model).save(str(d / "model_ts.pt"))
    h = DigitsHandler()
    h.initialize(
        _context(d, {"batchSize": 8, "handler": {"format": "torchscript"}}, _manifest("model_ts.pt"))
    )
    px = digits[0][:8]
    torch.testing.assert_close(h.logits(h.normalise(px)), _expected_logits(reference_model, px))


def test_module_defines_exactly_one_class() -> None:
    """TorchServe's handler loader refuses a module that defines more than one class."""
    classes = [c for _, c in inspect.getmembers(dh, inspect.isclass) if c.__module__ == dh.__name__]
    assert classes == [DigitsHandler]


# -- no `ts` at import or run time ----------------------------------------------------------

_NO_TS_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys
    sys.modules["ts"] = None  # any "import ts..." now raises ImportError
    try:
        import ts  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("blocking ts did not work")
    root, model_dir = sys.argv[1], sys.argv[2]
    spec = importlib.util.spec_from_file_location("h", root + "/handlers/digits_handler.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.path.insert(0, root)
    from mariner.server.worker.context import Context
    manifest = {"model": {"modelName": "d", "serializedFile": "weights.pt"}}
    cfg = {"handler": {"format": "eager", "model_kwargs": json.loads(sys.argv[3])}}
    ctx = Context("d", model_dir, manifest, batch_size=2, gpu_id=None, model_yaml_config=cfg)
    h = mod.DigitsHandler()
    h.initialize(ctx)
    ctx.begin_batch(["a", "b"], [{}, {}])
    out = h.handle([{"data": [1] * 64}, {"body": b"oops"}], ctx)
    assert sys.modules["ts"] is None
    assert not any(m.startswith("ts.") for m in sys.modules), "a ts submodule got imported"
    print(json.dumps(out))
    """
)


def test_handler_imports_and_runs_with_ts_blocked(model_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TS_SCRIPT, str(ROOT), str(model_dir), json.dumps(MODEL_KWARGS)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 <= out[0]["label"] <= 9
    assert out[1]["code"] == 400


# -- the runner's tensor contract -------------------------------------------------------------


def _runner_with(handle: Any) -> Any:
    """A ModelHost (what both the thread runner and a worker process run) whose handler is
    `handle`, without loading an archive."""
    from types import SimpleNamespace

    from mariner.server.worker.device import Placement
    from mariner.server.worker.runner import ModelHost

    archive = SimpleNamespace(name="digits", version="1.0", model_dir=Path("/nonexistent-model-dir"))
    host = ModelHost(archive, id="digits-1.0-0", placement=Placement(gpu_id=None), batch_size=4)  # type: ignore[arg-type]
    host._context = Context("digits", ".", {}, batch_size=4, gpu_id=None)
    host._handle = handle
    return host


def test_runner_takes_the_tensor_path_only_for_typed_tensor_requests() -> None:
    from mariner.server.contracts.types import InferRequest, WireProtocol

    arrays = {"pixels": np.zeros((2, 64), np.float32)}
    # A TorchServe request whose form field is named "tensors" (even holding arrays, which no
    # client can send) is handed over as it came and answered as bytes, never as tensors.
    spoof = InferRequest("digits", None, {"tensors": arrays}, WireProtocol.TS_HTTP, "r1")
    typed = InferRequest("digits", None, {}, WireProtocol.OIP_HTTP, "r2", tensors=arrays, items=2)
    seen: list[Any] = []

    def handle(data: list[Any], ctx: Any) -> list[Any]:
        seen.extend(data)
        return [{"tensors": {"label": [7, 7]}} for _ in data]

    host = _runner_with(handle)
    try:
        ts_result, oip_result = host.run_batch([spoof, typed])
    finally:
        host.unload()
    assert seen[0].keys() == spoof.data.keys()  # the form field as it came, not a tensor request
    assert seen[0]["tensors"] is spoof.data["tensors"]
    assert seen[1] == {"tensors": arrays}
    assert ts_result.tensors is None
    assert json.loads(ts_result.body) == {"tensors": {"label": [7, 7]}}  # encoded the TorchServe way
    assert oip_result.tensors is not None
    np.testing.assert_array_equal(oip_result.tensors["label"], [7, 7])
    assert oip_result.body == b""
