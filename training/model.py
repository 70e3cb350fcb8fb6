"""The digits CNN.

This file is self-contained (it imports only torch) because it travels inside the eager and
compiled archives as an extra file: the handler loads it from the unpacked archive, so
stock TorchServe and Mariner can rebuild the module without our source tree installed.
"""

from __future__ import annotations

import torch
from torch import nn

IMAGE_SIDE = 8
NUM_CLASSES = 10


def _conv_block(c_in: int, c_out: int) -> nn.Sequential:
    """conv -> BN -> ReLU; the conv has no bias because BN's shift makes it redundant."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class DigitsCNN(nn.Module):
    """Small CNN for normalised 1x8x8 digit images. Returns raw logits (no softmax).

    Keeping softmax out of the model lets training use CrossEntropyLoss directly and lets
    verification compare logits, the most sensitive signal, across exported variants.
    """

    def __init__(self, width: int = 32, hidden: int = 128, dropout: float = 0.25) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _conv_block(1, width),
            _conv_block(width, width),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            _conv_block(width, 2 * width),
            nn.MaxPool2d(2),  # 4x4 -> 2x2
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(2 * width * 2 * 2, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, NUM_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
