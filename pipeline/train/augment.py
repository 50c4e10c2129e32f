"""Image augmentation of training batches (He et al. 2016, Section 4.2, the CIFAR-10 recipe).

``crop_flip``: each image of an NCHW batch is zero-padded by ``pad`` pixels on each side, a
random crop of the original size is taken from it, and the crop is flipped horizontally with
probability 0.5. Draws come from torch's generator (seeded per run and worker), so a run is
reproducible.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def crop_flip(x: torch.Tensor, pad: int = 4, generator: torch.Generator | None = None) -> torch.Tensor:
    """A new batch: padded, randomly cropped back to (H, W), half of it mirrored left-right."""
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator).tolist()
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator).tolist()
    flip = (torch.rand(n, generator=generator) < 0.5).tolist()
    out = torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
    if any(flip):
        idx = torch.tensor([i for i in range(n) if flip[i]])
        out[idx] = out[idx].flip(-1)
    return out
