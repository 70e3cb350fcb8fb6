"""Image decoding and ImageNet preprocessing for the ResNet handler, bounded and batched.

Shipped in the resnet archives beside `resnet_handler.py`, which imports it by path (TorchServe
does not put the archive on sys.path for us); it imports only numpy, torch and Pillow.

Decoding is where an image server is attacked, so every limit is checked before work is done:
the pixel count is read from the header (`Image.open` parses only the header) and an image
over MAX_IMAGE_PIXELS is refused before a byte of pixels is decoded; only JPEG and PNG are
accepted; truncated files, non-images and empty bodies are refused with a message. Each of
these is a ValueError for that one request, which the handler answers with 400 while its
batch-mates are answered.

Preprocessing is torchvision's ImageNet evaluation transform (resize the shorter side to 256
with antialiased bilinear filtering, centre-crop 224, scale to 0..1, normalise with the
ImageNet mean and std), done without per-pixel Python: a JPEG is decoded at the smallest DCT
scale that still leaves the shorter side >= 256 (`Image.draft`, what Pillow's thumbnail does),
Pillow resizes in C, the crop is a numpy slice, and the whole batch is normalised by one tensor
op. (Resampling only the crop's box, `resize(box=...)`, was tried: Pillow's box path rounds
differently and moved 2% of the values by one grey level, so the plain order is kept.)
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch

RESIZE = 256
CROP = 224
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# A 48-megapixel phone photo (8000x6000) fits; its RGB decode is ~144 MB, transient, one image
# at a time. Anything larger is refused from its header alone.
MAX_IMAGE_PIXELS = 8192 * 8192
FORMATS = frozenset({"JPEG", "PNG"})
IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")

# x * SCALE - SHIFT == (x / 255 - mean) / std, per channel: one multiply-add over the batch.
_SCALE = torch.tensor([1.0 / (255.0 * s) for s in STD], dtype=torch.float32).view(1, 3, 1, 1)
_SHIFT = torch.tensor([m / s for m, s in zip(MEAN, STD, strict=True)], dtype=torch.float32).view(1, 3, 1, 1)


def looks_like_image(raw: bytes) -> bool:
    return raw.startswith(IMAGE_MAGIC)


def crop_box(width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The resized size (shorter side RESIZE) and the centre crop's (top, left) in it.

    Same arithmetic as torchvision's Resize(256) (the longer side truncated to int) and
    CenterCrop(224) (offset rounded).
    """
    if width <= height:
        new_w, new_h = RESIZE, int(RESIZE * height / width)
    else:
        new_w, new_h = int(RESIZE * width / height), RESIZE
    return (new_w, new_h), (int(round((new_h - CROP) / 2.0)), int(round((new_w - CROP) / 2.0)))


def decode(raw: bytes) -> np.ndarray:
    """One JPEG/PNG -> its (CROP, CROP, 3) uint8 centre crop; ValueError says what was wrong."""
    from PIL import Image, UnidentifiedImageError

    if not raw:
        raise ValueError("empty body: send one JPEG or PNG image")
    try:
        img: Image.Image = Image.open(io.BytesIO(raw))  # parses the header only
    except Image.DecompressionBombError as exc:  # Pillow's own cap (above ours), also from the header
        raise ValueError(
            f"image is too large: {exc}; at most {MAX_IMAGE_PIXELS} pixels are accepted"
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(f"body is not a JPEG or PNG image ({type(exc).__name__}: {exc})") from None
    if img.format not in FORMATS:
        raise ValueError(f"image format {img.format} is not accepted; send JPEG or PNG")
    width, height = img.size
    if width < 1 or height < 1:
        raise ValueError(f"image is {width}x{height}; it has no pixels")
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"image is {width}x{height} ({width * height} pixels); at most {MAX_IMAGE_PIXELS} pixels "
            "are accepted (it is scaled to 224x224 anyway)"
        )
    try:
        if img.format == "JPEG":
            # Decode at 1/2, 1/4 or 1/8 scale when the shorter side stays >= RESIZE.
            short = min(width, height)
            img.draft("RGB", (math.ceil(width * RESIZE / short), math.ceil(height * RESIZE / short)))
        img = img.convert("RGB")  # decodes; L, P, RGBA, CMYK all become RGB
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"image could not be decoded ({type(exc).__name__}: {exc})") from None
    size, (top, left) = crop_box(*img.size)
    resized = np.asarray(img.resize(size, Image.Resampling.BILINEAR), dtype=np.uint8)
    return resized[top : top + CROP, left : left + CROP]


def normalise(crops: np.ndarray | list[np.ndarray]) -> torch.Tensor:
    """(N, CROP, CROP, 3) uint8 crops -> (N, 3, CROP, CROP) float32, ImageNet-normalised."""
    batch = torch.from_numpy(np.ascontiguousarray(np.stack(crops) if isinstance(crops, list) else crops))
    return torch.addcmul(-_SHIFT, batch.permute(0, 3, 1, 2).float(), _SCALE).contiguous()


def preprocess(images: list[bytes]) -> torch.Tensor:
    """Encoded images -> one normalised (N, 3, 224, 224) batch (raises on the first bad one)."""
    return normalise([decode(raw) for raw in images])


def check_tensor(arr: np.ndarray, name: str) -> torch.Tensor:
    """An OIP FP32 [N, 3, 224, 224] input (already normalised) as a tensor, checked."""
    if arr.dtype != np.float32:
        raise ValueError(f"input {name!r} must be FP32 [N, 3, 224, 224] or BYTES images, got {arr.dtype}")
    if arr.ndim != 4 or arr.shape[1:] != (3, CROP, CROP) or arr.shape[0] < 1:
        raise ValueError(
            f"input {name!r} must have shape [N, 3, 224, 224] with N >= 1, got {list(arr.shape)}"
        )
    if not np.isfinite(arr).all():
        raise ValueError(f"input {name!r} must hold finite numbers (no NaN or Infinity)")
    return torch.from_numpy(np.ascontiguousarray(arr))
