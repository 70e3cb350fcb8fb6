"""ResNet-18 workload: architecture keys, image decoding rules, batched preprocessing, handler.

The handler is loaded from a staged eager model dir (seeded weights, no BN calibration: these
tests are about the serving code, not the numbers), exactly as a server would load it.
"""

from __future__ import annotations

import io
import math
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mariner.handlers import resnet_image
from mariner.training import image_data
from mariner.training.resnet.model import ResNet18

pytestmark = pytest.mark.unit

# torchvision.models.resnet18().state_dict() keys, in order (torchvision 0.2x), as data.
TORCHVISION_RESNET18_KEYS = """
    conv1.weight bn1.weight bn1.bias bn1.running_mean bn1.running_var bn1.num_batches_tracked
    layer1.0.conv1.weight layer1.0.bn1.weight layer1.0.bn1.bias layer1.0.bn1.running_mean
    layer1.0.bn1.running_var layer1.0.bn1.num_batches_tracked layer1.0.conv2.weight layer1.0.bn2.weight
    layer1.0.bn2.bias layer1.0.bn2.running_mean layer1.0.bn2.running_var
    layer1.0.bn2.num_batches_tracked layer1.1.conv1.weight layer1.1.bn1.weight layer1.1.bn1.bias
    layer1.1.bn1.running_mean layer1.1.bn1.running_var layer1.1.bn1.num_batches_tracked
    layer1.1.conv2.weight layer1.1.bn2.weight layer1.1.bn2.bias layer1.1.bn2.running_mean
    layer1.1.bn2.running_var layer1.1.bn2.num_batches_tracked layer2.0.conv1.weight layer2.0.bn1.weight
    layer2.0.bn1.bias layer2.0.bn1.running_mean layer2.0.bn1.running_var
    layer2.0.bn1.num_batches_tracked layer2.0.conv2.weight layer2.0.bn2.weight layer2.0.bn2.bias
    layer2.0.bn2.running_mean layer2.0.bn2.running_var layer2.0.bn2.num_batches_tracked
    layer2.0.downsample.0.weight layer2.0.downsample.1.weight layer2.0.downsample.1.bias
    layer2.0.downsample.1.running_mean layer2.0.downsample.1.running_var
    layer2.0.downsample.1.num_batches_tracked layer2.1.conv1.weight layer2.1.bn1.weight
    layer2.1.bn1.bias layer2.1.bn1.running_mean layer2.1.bn1.running_var
    layer2.1.bn1.num_batches_tracked layer2.1.conv2.weight layer2.1.bn2.weight layer2.1.bn2.bias
    layer2.1.bn2.running_mean layer2.1.bn2.running_var layer2.1.bn2.num_batches_tracked
    layer3.0.conv1.weight layer3.0.bn1.weight layer3.0.bn1.bias layer3.0.bn1.running_mean
    layer3.0.bn1.running_var layer3.0.bn1.num_batches_tracked layer3.0.conv2.weight layer3.0.bn2.weight
    layer3.0.bn2.bias layer3.0.bn2.running_mean layer3.0.bn2.running_var
    layer3.0.bn2.num_batches_tracked layer3.0.downsample.0.weight layer3.0.downsample.1.weight
    layer3.0.downsample.1.bias layer3.0.downsample.1.running_mean layer3.0.downsample.1.running_var
    layer3.0.downsample.1.num_batches_tracked layer3.1.conv1.weight layer3.1.bn1.weight
    layer3.1.bn1.bias layer3.1.bn1.running_mean layer3.1.bn1.running_var
    layer3.1.bn1.num_batches_tracked layer3.1.conv2.weight layer3.1.bn2.weight layer3.1.bn2.bias
    layer3.1.bn2.running_mean layer3.1.bn2.running_var layer3.1.bn2.num_batches_tracked
    layer4.0.conv1.weight layer4.0.bn1.weight layer4.0.bn1.bias layer4.0.bn1.running_mean
    layer4.0.bn1.running_var layer4.0.bn1.num_batches_tracked layer4.0.conv2.weight layer4.0.bn2.weight
    layer4.0.bn2.bias layer4.0.bn2.running_mean layer4.0.bn2.running_var
    layer4.0.bn2.num_batches_tracked layer4.0.downsample.0.weight layer4.0.downsample.1.weight
    layer4.0.downsample.1.bias layer4.0.downsample.1.running_mean layer4.0.downsample.1.running_var
    layer4.0.downsample.1.num_batches_tracked layer4.1.conv1.weight layer4.1.bn1.weight
    layer4.1.bn1.bias layer4.1.bn1.running_mean layer4.1.bn1.running_var
    layer4.1.bn1.num_batches_tracked layer4.1.conv2.weight layer4.1.bn2.weight layer4.1.bn2.bias
    layer4.1.bn2.running_mean layer4.1.bn2.running_var layer4.1.bn2.num_batches_tracked fc.weight
    fc.bias
""".split()  # noqa: SIM905 (whitespace-separated data reads better than 122 quoted strings)


def _png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height (RGB) but carries one compressed row: a decompression bomb."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + payload))
        return struct.pack(">I", len(payload)) + kind + payload + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * (1 + 3 * min(width, 64)))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


class RecordingContext:
    """The part of TorchServe's Context a handler reports per-request statuses through."""

    def __init__(self) -> None:
        self.statuses: dict[int, int] = {}

    def set_response_status(self, code: int, phrase: str = "", idx: int = 0) -> None:
        self.statuses[idx] = code


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    return image_data.encoded_set(4, seed=11)


@pytest.fixture(scope="module")
def handler(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mariner.training.export import Artefact
    from mariner.training.resnet import package, weights
    from mariner.training.resnet.verify import load_staged

    work = tmp_path_factory.mktemp("resnet")
    torch.manual_seed(0)
    state = work / "resnet18_eager.pt"
    torch.save(ResNet18().eval().state_dict(), state)
    staged = package.stage(
        Artefact("eager", state, "eager", "any", 0.0), work=work / "stage",
        labels=weights.labels(), batch_size=8, max_batch_delay_ms=5,
    )  # fmt: skip
    return load_staged(staged)


class CountingModel(torch.nn.Module):
    """Wraps the loaded model and records the rows of every forward pass."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(len(x))
        return self.inner(x)


@pytest.fixture
def counting(handler: Any) -> Iterator[CountingModel]:
    inner, chunk = handler.model, handler.chunk
    handler.model = CountingModel(inner)
    try:
        yield handler.model
    finally:
        handler.model, handler.chunk = inner, chunk


# -- architecture -----------------------------------------------------------------------------
def test_state_dict_keys_are_torchvision_resnet18s() -> None:
    state = ResNet18().state_dict()
    assert len(TORCHVISION_RESNET18_KEYS) == 122
    assert list(state) == TORCHVISION_RESNET18_KEYS
    assert sum(p.numel() for p in ResNet18().parameters()) == 11_689_512  # torchvision's count
    assert state["conv1.weight"].shape == (64, 3, 7, 7)
    assert state["layer4.0.downsample.0.weight"].shape == (512, 256, 1, 1)
    assert state["fc.weight"].shape == (1000, 512)


# -- decoding rules ---------------------------------------------------------------------------
def test_crop_box_follows_torchvisions_resize_and_centre_crop() -> None:
    assert resnet_image.crop_box(640, 427) == ((383, 256), (16, 80))
    assert resnet_image.crop_box(300, 600) == ((256, 512), (144, 16))
    assert resnet_image.crop_box(256, 256) == ((256, 256), (16, 16))


def test_oversized_header_is_refused_before_any_pixel_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import ImageFile

    def no_decoding(self: Any) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    for width, height in ((20000, 20000), (9000, 9000)):  # over Pillow's own cap, and over ours only
        with pytest.raises(ValueError, match="pixels are accepted"):
            resnet_image.decode(_png_header(width, height))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "empty body"),
        (b"hello, not an image", "not a JPEG or PNG"),
        (_encode(Image.new("RGB", (32, 32)), "GIF"), "format GIF is not accepted"),
        (_png_header(300, 300), "could not be decoded"),  # one row of 300: truncated data
    ],
)
def test_bad_bodies_are_value_errors(body: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resnet_image.decode(body)


def test_truncated_jpeg_is_refused(jpegs: list[bytes]) -> None:
    with pytest.raises(ValueError, match="could not be decoded"):
        resnet_image.decode(jpegs[0][: len(jpegs[0]) // 2])


def test_grey_and_alpha_images_become_rgb() -> None:
    for img in (Image.new("L", (300, 200), 90), Image.new("RGBA", (200, 300), (10, 20, 30, 0))):
        crop = resnet_image.decode(_encode(img, "PNG"))
        assert crop.shape == (224, 224, 3)
        assert crop.dtype == np.uint8


def _reference(raw: bytes) -> np.ndarray:
    """Per image, the plain way: resize the shorter side to 256, crop, normalise channel by channel."""
    img = Image.open(io.BytesIO(raw))
    if img.format == "JPEG":  # the same reduced-scale JPEG decode the handler uses
        short = min(img.size)
        img.draft("RGB", (math.ceil(img.size[0] * 256 / short), math.ceil(img.size[1] * 256 / short)))
    img = img.convert("RGB")
    w, h = img.size
    size = (256, int(256 * h / w)) if w <= h else (int(256 * w / h), 256)
    arr = np.asarray(img.resize(size, Image.Resampling.BILINEAR), dtype=np.float64) / 255.0
    top, left = round((size[1] - 224) / 2), round((size[0] - 224) / 2)
    arr = arr[top : top + 224, left : left + 224]
    out = np.empty((3, 224, 224))
    for c in range(3):
        out[c] = (arr[:, :, c] - resnet_image.MEAN[c]) / resnet_image.STD[c]
    return out


def test_batched_preprocessing_matches_the_per_image_reference() -> None:
    images = image_data.encoded_set(6, seed=3) + image_data.encoded_set(3, seed=4, fmt="png")
    batch = resnet_image.preprocess(images)
    assert batch.shape == (9, 3, 224, 224)
    assert batch.dtype == torch.float32
    reference = np.stack([_reference(raw) for raw in images])
    assert np.abs(batch.numpy() - reference).max() <= 1e-5
    assert batch.std() > 0.3  # real photos, not a blank batch


def test_image_data_is_deterministic_and_varied() -> None:
    first = image_data.encoded_set(8, seed=5)
    assert first == image_data.encoded_set(8, seed=5)
    sizes = [Image.open(io.BytesIO(b)).size for b in first]
    assert all(image_data.MIN_SIDE <= s <= image_data.MAX_SIDE for wh in sizes for s in wh)
    assert len(set(sizes)) == len(sizes)
    assert all(b.startswith(b"\xff\xd8\xff") for b in first)
    assert image_data.encoded_set(1, seed=5, fmt="png")[0].startswith(b"\x89PNG")


# -- the handler ------------------------------------------------------------------------------
def _check_topk(answer: dict[str, Any]) -> None:
    topk = answer["topk"]
    assert len(topk) == 5
    probs = [t["probability"] for t in topk]
    assert probs == sorted(probs, reverse=True)
    assert all(t["label"] == f"class_{t['index']:03d}" for t in topk)
    assert len({t["index"] for t in topk}) == 5


def test_each_bad_request_fails_alone_and_batch_mates_are_answered(
    handler: Any, jpegs: list[bytes], counting: CountingModel
) -> None:
    png = _encode(Image.open(io.BytesIO(jpegs[1])), "PNG")
    data = [
        {"body": jpegs[0]},
        {"body": b""},
        {"body": b"not an image"},
        {"data": jpegs[2][:200]},  # truncated
        {"file": png},  # a multipart field of any name
        {"body": _png_header(20000, 20000)},
        {"body": "some text"},  # text/* arrives as str
        {"data": bytearray(jpegs[3])},
        {"body": {"instances": [1, 2]}},  # JSON
    ]
    ctx = RecordingContext()
    results = handler.handle(data, ctx)
    assert len(results) == len(data)
    bad = {1, 2, 3, 5, 6, 8}
    assert ctx.statuses == dict.fromkeys(bad, 400)
    for i, answer in enumerate(results):
        if i in bad:
            assert answer["code"] == 400
            assert answer["error"]
        else:
            _check_topk(answer)
    assert counting.calls == [3]  # one forward for the whole batch's good images


def test_answers_do_not_depend_on_batch_mates(handler: Any, jpegs: list[bytes]) -> None:
    alone = handler.handle([{"body": jpegs[0]}], None)[0]
    together = handler.handle([{"body": jpegs[1]}, {"body": jpegs[0]}], None)[1]
    assert [t["index"] for t in alone["topk"]] == [t["index"] for t in together["topk"]]
    for a, b in zip(alone["topk"], together["topk"], strict=True):
        assert a["probability"] == pytest.approx(b["probability"], abs=1e-5)


def test_tensor_requests_bytes_and_fp32(handler: Any, jpegs: list[bytes]) -> None:
    images = np.array(jpegs[:2], dtype=object)
    fp32 = resnet_image.preprocess(jpegs[:2]).numpy()
    ctx = RecordingContext()
    results = handler.handle(
        [
            {"tensors": {"image": images}},
            {"tensors": {"image": images.reshape(2, 1)}},
            {"tensors": {"x": fp32}},
            {"body": jpegs[0]},
            {"tensors": {"x": np.zeros((2, 3, 32, 32), np.float32)}},
            {"tensors": {"image": np.array([jpegs[0], b"junk"], dtype=object)}},
            {"tensors": {"x": np.full((1, 3, 224, 224), np.nan, np.float32)}},
        ],
        ctx,
    )
    assert ctx.statuses == {4: 400, 5: 400, 6: 400}
    assert "[N, 3, 224, 224]" in results[4]["error"]
    assert "element 1" in results[5]["error"]
    first = results[0]["tensors"]
    assert first["probabilities"].shape == (2, 5)
    assert first["probabilities"].dtype == np.float32
    assert first["indices"].dtype == np.int64
    for other in (results[1]["tensors"], results[2]["tensors"]):
        np.testing.assert_array_equal(other["indices"], first["indices"])
        np.testing.assert_allclose(other["probabilities"], first["probabilities"], atol=1e-6)
    assert [t["index"] for t in results[3]["topk"]] == first["indices"][0].tolist()


def test_forward_passes_are_capped_at_the_rows_per_call(handler: Any, counting: CountingModel) -> None:
    handler.chunk = 2
    x = resnet_image.normalise(np.zeros((5, 224, 224, 3), np.uint8)).numpy()
    results = handler.handle([{"tensors": {"x": x}}], None)
    assert counting.calls == [2, 2, 1]
    assert results[0]["tensors"]["indices"].shape == (5, 5)


def test_model_config_reaches_the_server_settings(tmp_path: Path) -> None:
    from mariner.server.contracts.tensors import ModelSignature
    from mariner.training.resnet import package

    cfg = package.model_config("aoti", "cpu", batch_size=16, max_batch_delay_ms=3)
    assert (cfg["batchSize"], cfg["maxBatchDelay"], cfg["deviceType"]) == (16, 3, "cpu")
    assert "deviceType" not in package.model_config("onnx", "any", batch_size=16, max_batch_delay_ms=3)
    sig = ModelSignature.from_config(cfg["signature"])
    assert sig is not None
    assert [(s.name, s.datatype, s.shape, s.optional) for s in sig.inputs] == [
        ("image", "BYTES", (-1,), True),
        ("pixels", "FP32", (-1, 3, 224, 224), True),
    ]
    assert {s.name for s in sig.outputs} == {"probabilities", "indices"}


def test_padded_variants_run_only_at_warmed_buckets(
    handler: Any, jpegs: list[bytes], counting: CountingModel
) -> None:
    """The compiled variant's rule: a batch is zero-padded up to a bucket, larger ones are cut
    into top-bucket chunks, and padding rows never change the real rows' answers."""
    unpadded = handler.handle([{"body": raw} for raw in jpegs[:3]], None)
    counting.calls.clear()
    buckets, pad = handler.buckets, handler._pad
    handler.buckets, handler._pad = [1, 2, 4, 8], True
    try:
        padded = handler.handle([{"body": raw} for raw in jpegs[:3]], None)
        x = resnet_image.normalise(np.zeros((10, 224, 224, 3), np.uint8)).numpy()
        handler.handle([{"tensors": {"x": x}}], None)
    finally:
        handler.buckets, handler._pad = buckets, pad
    assert counting.calls == [4, 8, 2]
    for a, b in zip(unpadded, padded, strict=True):
        assert [t["index"] for t in a["topk"]] == [t["index"] for t in b["topk"]]
        np.testing.assert_allclose(
            [t["probability"] for t in a["topk"]], [t["probability"] for t in b["topk"]], atol=1e-5
        )
