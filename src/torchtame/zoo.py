"""Small built-in models for the quickstart and the tests (trained on the spot, no download)."""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """A compact CNN for 8x8 digits: three conv-bn-relu blocks and a two-layer classifier."""

    def __init__(self, width: int = 32, hidden: int = 256, num_classes: int = 10) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * w),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 4 * w, 3, padding=1, bias=False),
            nn.BatchNorm2d(4 * w),
            nn.ReLU(),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(4 * w * 16, hidden),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


def digits_cnn(width: int = 32, hidden: int = 256, num_classes: int = 10) -> DigitsCNN:
    return DigitsCNN(width=width, hidden=hidden, num_classes=num_classes)


class DigitsMLP(nn.Module):
    """A Linear-heavy MLP on flattened 8x8 digits (dynamic quantization's natural target)."""

    def __init__(self, hidden: int = 512, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.net(x)


def digits_mlp(hidden: int = 512, num_classes: int = 10) -> DigitsMLP:
    return DigitsMLP(hidden=hidden, num_classes=num_classes)


class DigitsMobileNet(nn.Module):
    """torchvision's mobilenet_v2 (width 0.5) on the 8x8 digits, upsampled 4x to 3x32x32: real
    model code with depthwise convolutions, small enough to train here."""

    def __init__(self) -> None:
        super().__init__()
        import torchvision

        self.net = torchvision.models.mobilenet_v2(num_classes=10, width_mult=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(nn.functional.interpolate(x, scale_factor=4).repeat(1, 3, 1, 1))
