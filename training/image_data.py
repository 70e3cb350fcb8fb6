"""Real photographs for the image-classification workload, with no download.

scikit-learn ships two JPEG photographs (`sklearn.datasets.load_sample_images`: a temple in
China and a flower, 640x427 each). Real photos matter for this workload even with untrained
weights: JPEG decode cost, resize cost and BatchNorm statistics depend on natural image
content and on varied sizes, which random noise or one fixed size would hide.

`encoded_set` cuts deterministic crops out of the two photos, scales them to varied sizes
(about 160..640 px a side, aspect ratios mixed) and encodes them as JPEG or PNG: the request
bodies a client would send. The same seed gives the same bytes, so benchmarks and
verification are repeatable.
"""

from __future__ import annotations

import io
from functools import cache

import numpy as np

MIN_SIDE = 160
MAX_SIDE = 640
FORMATS = ("jpeg", "png")
JPEG_QUALITY = 90


@cache
def _photos() -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_sample_images

    images = load_sample_images().images
    return tuple(np.ascontiguousarray(image, dtype=np.uint8) for image in images)


def photos() -> list[np.ndarray]:
    """The two sample photos as HxWx3 uint8 arrays (copies: callers may write into them)."""
    return [image.copy() for image in _photos()]


def crops(n: int, seed: int) -> list[np.ndarray]:
    """`n` deterministic HxWx3 uint8 crops of the photos, each side within MIN_SIDE..MAX_SIDE.

    A crop keeps at least a quarter of the photo's shorter side, so it shows real structure
    (edges, texture) rather than a few flat pixels blown up.
    """
    from PIL import Image

    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    sources = _photos()
    out: list[np.ndarray] = []
    for _ in range(n):
        photo = sources[int(rng.integers(len(sources)))]
        height, width = photo.shape[:2]
        short = min(height, width)
        crop_h = int(rng.integers(short // 4, height + 1))
        crop_w = int(rng.integers(short // 4, width + 1))
        top = int(rng.integers(0, height - crop_h + 1))
        left = int(rng.integers(0, width - crop_w + 1))
        out_h = int(rng.integers(MIN_SIDE, MAX_SIDE + 1))
        out_w = int(rng.integers(MIN_SIDE, MAX_SIDE + 1))
        piece = Image.fromarray(photo[top : top + crop_h, left : left + crop_w])
        out.append(np.asarray(piece.resize((out_w, out_h), Image.Resampling.BILINEAR), dtype=np.uint8))
    return out


def encode(image: np.ndarray, fmt: str = "jpeg") -> bytes:
    """One HxWx3 uint8 image encoded as JPEG (quality JPEG_QUALITY) or PNG."""
    from PIL import Image

    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    buffer = io.BytesIO()
    if fmt == "jpeg":
        Image.fromarray(image).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    else:
        Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def encoded_set(n: int, seed: int, fmt: str = "jpeg") -> list[bytes]:
    """`n` real photo crops of varied sizes, encoded as `fmt` ("jpeg" or "png")."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    return [encode(image, fmt) for image in crops(n, seed)]
