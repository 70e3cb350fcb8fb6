"""ResNet-18 written out, with torchvision's module names, so its state_dict keys are torchvision's.

The archives must not need torchvision (it is an optional extra; the registry's build loads
beside the pinned CPU torch only through Mariner's nms shim): this file is shipped in the eager
and compiled archives as `resnet_model.py` and imported by the handler, so it imports only
torch. The layout (conv1, bn1, layer1..4 of BasicBlocks with conv1/bn1/conv2/bn2/downsample.0/.1,
fc) and the initialisation follow torchvision.models.resnet18 exactly, so a real torchvision
checkpoint loads into it unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

NUM_CLASSES = 1000
LAYERS = (2, 2, 2, 2)  # BasicBlocks per stage: ResNet-18


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (1x1 conv + BN when the shape changes)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        # torchvision calls one `relu` twice; a second module (no state: the keys are unchanged)
        # gives each call its own source partition, which PT2E's x86 quantizer needs to match
        # conv-bn-add-relu (one shared module became one partition with two outputs).
        self.relu_out = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu_out(out)


class ResNet18(nn.Module):
    """torchvision's resnet18: (N, 3, 224, 224) ImageNet-normalised images -> (N, 1000) logits."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._stage(64, 64, LAYERS[0], stride=1)
        self.layer2 = self._stage(64, 128, LAYERS[1], stride=2)
        self.layer3 = self._stage(128, 256, LAYERS[2], stride=2)
        self.layer4 = self._stage(256, 512, LAYERS[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        # torchvision's initialisation: He (fan_out) for convolutions, BN as identity.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    @staticmethod
    def _stage(inplanes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [BasicBlock(inplanes, planes, stride)]
        layers += [BasicBlock(planes, planes) for _ in range(blocks - 1)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
