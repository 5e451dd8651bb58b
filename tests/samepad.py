"""A model ported from TensorFlow as people port them: every convolution is a Conv2d subclass that
pads 'same' in its own forward and calls F.conv2d (the EfficientNet-port pattern). torch.ao FX
traces through it into functional convolutions with standalone BatchNorms; PT2E needs its graph
normalised to see the convolutions."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Conv2dSame(nn.Conv2d):
    """TensorFlow 'SAME' padding for a known image size, as EfficientNet-PyTorch's
    Conv2dStaticSamePadding: a ZeroPad2d computed in __init__, then F.conv2d in forward."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, image_size: int = 32, **kw) -> None:
        super().__init__(cin, cout, k, stride, **kw)
        pad = max((math.ceil(image_size / stride) - 1) * stride + k - image_size, 0)
        self.static_padding = nn.ZeroPad2d((pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.static_padding(x)
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


def block(cin: int, cout: int, stride: int, size: int, groups: int = 1) -> nn.Sequential:
    conv = Conv2dSame(cin, cout, 3, stride, image_size=size, groups=groups, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(cout), nn.ReLU6())


class PortedNet(nn.Module):
    """A small EfficientNet-lite-like stack: stem, depthwise-separable blocks, classifier."""

    def __init__(self, classes: int = 10, width: int = 16) -> None:
        super().__init__()
        w = width
        self.stem = block(3, w, 2, 32)
        self.blocks = nn.Sequential(
            block(w, w, 1, 16, groups=w),
            nn.Sequential(
                Conv2dSame(w, 2 * w, 1, image_size=16, bias=False), nn.BatchNorm2d(2 * w), nn.ReLU6()
            ),
            block(2 * w, 2 * w, 2, 16, groups=2 * w),
            nn.Sequential(
                Conv2dSame(2 * w, 4 * w, 1, image_size=8, bias=False), nn.BatchNorm2d(4 * w), nn.ReLU6()
            ),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def ported_net() -> PortedNet:
    torch.manual_seed(0)
    return PortedNet()
