"""Models: LeNet-5, ResNet-20 (CIFAR-style), and the three LHC topology classifiers.

* ``LeNet5``: conv(6,5x5) -> pool -> conv(16,5x5) -> pool -> 120 -> 84 -> classes, ReLU,
  max-pooling; inputs smaller than 32x32 are zero-padded in the convolutions (28x28 MNIST
  behaves like the classic 32x32 input). ``lenet5_bn``: the same with BatchNorm after each
  convolution and each hidden dense layer (before the ReLU): H&B's E1 question is BatchNorm with
  small local batches, which a network without BatchNorm cannot ask (every worker normalises with
  the statistics of its own local batch; under AR-SGD only the gradients are averaged).
* ``ResNet20``: He et al. 2016 CIFAR ResNet (3 stages x 3 basic blocks, 16/32/64 channels,
  option-A identity shortcuts with zero padding), BatchNorm.
* ``HLFClassifier``: dense 14 -> 50 -> 20 -> 10 -> 3 (ReLU), as in the CERN topology classifier.
* ``ParticleGRU``: GRU (width 50) over the particle sequence with padded particles masked
  (packed sequences; the hidden state of the last REAL particle is used), dense -> 3.
* ``InclusiveClassifier``: that GRU branch concatenated with the 14 HLF inputs, dense 25 -> 3.

Every model's ``forward(*inputs)`` takes the tuple the reader's transform produces and
returns logits (the loss is cross-entropy).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..features.layout import N_CLASSES, N_HLF, N_LLF_FEATURES


class LeNet5(nn.Module):
    def __init__(self, in_channels: int = 1, height: int = 28, width: int = 28, num_classes: int = 10,
                 batchnorm: bool = False):
        super().__init__()
        side = min(height, width)
        self.conv1 = nn.Conv2d(in_channels, 6, 5, padding=2 if side < 32 else 0)
        self.conv2 = nn.Conv2d(6, 16, 5, padding=2 if side < 16 else 0)
        norm2, norm1 = (nn.BatchNorm2d, nn.BatchNorm1d) if batchnorm else (lambda _: nn.Identity(),) * 2
        self.bn1, self.bn2 = norm2(6), norm2(16)
        self.eval()  # the shape probe must not touch BatchNorm's running statistics
        with torch.no_grad():
            n = self._features(torch.zeros(1, in_channels, height, width)).shape[1]
        self.train()
        self.fc1 = nn.Linear(n, 120)
        self.fc2 = nn.Linear(120, 84)
        self.bn3, self.bn4 = norm1(120), norm1(84)
        self.fc3 = nn.Linear(84, num_classes)

    def _features(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return torch.flatten(x, 1)

    def forward(self, x):
        x = self._features(x)
        return self.fc3(F.relu(self.bn4(self.fc2(F.relu(self.bn3(self.fc1(x)))))))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.pad = cout - cin
        self.stride = stride

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        sc = x
        if self.stride != 1 or self.pad:
            sc = x[:, :, ::self.stride, ::self.stride]
            sc = F.pad(sc, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return F.relu(out + sc)


class ResNet20(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 10, blocks: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(blocks):
                layers.append(_Block(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class HLFClassifier(nn.Module):
    def __init__(self, n_inputs: int = N_HLF, num_classes: int = N_CLASSES):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_inputs, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(),
                                 nn.Linear(20, 10), nn.ReLU(), nn.Linear(10, num_classes))

    def forward(self, x):
        return self.net(x)


class GRUBranch(nn.Module):
    """GRU over (batch, particles, features); returns the hidden state after the last real particle."""

    def __init__(self, n_features: int = N_LLF_FEATURES, width: int = 50):
        super().__init__()
        self.gru = nn.GRU(n_features, width, batch_first=True)

    def forward(self, x, n_particles):
        lengths = n_particles.clamp(min=1).to("cpu", torch.int64)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        return h[-1]


class ParticleGRU(nn.Module):
    def __init__(self, n_features: int = N_LLF_FEATURES, width: int = 50, num_classes: int = N_CLASSES):
        super().__init__()
        self.branch = GRUBranch(n_features, width)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x, n_particles):
        return self.fc(self.branch(x, n_particles))


class InclusiveClassifier(nn.Module):
    def __init__(self, n_features: int = N_LLF_FEATURES, width: int = 50, n_hlf: int = N_HLF,
                 num_classes: int = N_CLASSES):
        super().__init__()
        self.branch = GRUBranch(n_features, width)
        self.fc1 = nn.Linear(width + n_hlf, 25)
        self.fc2 = nn.Linear(25, num_classes)

    def forward(self, x, n_particles, hlf):
        z = torch.cat([self.branch(x, n_particles), hlf], dim=1)
        return self.fc2(F.relu(self.fc1(z)))


def he_init_(model: nn.Module) -> nn.Module:
    """He et al. 2015 initialisation: every convolution and linear weight drawn from
    N(0, 2 / fan_in), biases set to 0 (recurrent layers keep torch's)."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return model


def build_model(name: str, num_classes: int, shape: dict | None = None, init: str = "default") -> nn.Module:
    """The model ``name``; ``init="he"`` re-draws its weights with :func:`he_init_`."""
    model = _build(name, num_classes, shape or {})
    return he_init_(model) if init == "he" else model


def _build(name: str, num_classes: int, shape: dict) -> nn.Module:
    if name in ("lenet5", "lenet5_bn"):
        return LeNet5(shape.get("channels", 1), shape.get("height", 28), shape.get("width", 28), num_classes,
                      batchnorm=name == "lenet5_bn")
    if name == "resnet20":
        return ResNet20(shape.get("channels", 3), num_classes)
    if name == "hlf":
        return HLFClassifier(N_HLF, num_classes)
    if name == "gru":
        return ParticleGRU(num_classes=num_classes)
    if name == "inclusive":
        return InclusiveClassifier(num_classes=num_classes)
    raise ValueError(f"unknown model {name!r}")
