"""Seeded ResNet-18 weights with BatchNorm statistics measured on real photos.

This is a PERFORMANCE workload: the weights are not trained (no ImageNet, no download, and no
PyPI package was found that ships real ResNet-18 ImageNet weights as a file), so its top-1
"accuracy" means nothing. What must be realistic is the arithmetic: torchvision's
initialisation (He fan_out for convolutions) and BatchNorm running statistics calibrated by
running real photo crops (scikit-learn's sample photos, `image_data`) through the network in
train mode, so every layer's activations are in the range a trained network's would be, and
fp32/int8 numerical comparisons are made at realistic magnitudes.
"""

from __future__ import annotations

import torch
from torch import nn

from mariner.training.resnet.model import NUM_CLASSES, ResNet18

SEED = 0
CALIBRATION_IMAGES = 32  # BN statistics: a cumulative average over this many photo crops
CALIBRATION_SEED = 1234  # crops used for BN statistics (verification uses other seeds)


def labels() -> list[str]:
    """1000 placeholder class names: the weights are untrained, so ImageNet names would lie."""
    return [f"class_{i:03d}" for i in range(NUM_CLASSES)]


def calibration_batch(n: int, seed: int) -> torch.Tensor:
    """n real photo crops, preprocessed exactly as the handler preprocesses requests."""
    from mariner.handlers import resnet_image
    from mariner.training.image_data import encoded_set

    return resnet_image.preprocess(encoded_set(n, seed))


def make_model(seed: int = SEED, images: int = CALIBRATION_IMAGES) -> ResNet18:
    """The seeded network, BN statistics calibrated on `images` photo crops, in eval mode."""
    torch.manual_seed(seed)
    model = ResNet18()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # cumulative average over all calibration batches
    model.train()
    with torch.no_grad():
        for chunk in calibration_batch(images, CALIBRATION_SEED).split(16):
            model(chunk)
    return model.eval()
