"""Models: shapes, sizes and the particle-sequence masking."""
from __future__ import annotations

import pytest
import torch

from pipeline.train.models import (HLFClassifier, InclusiveClassifier, LeNet5, ParticleGRU, ResNet20,
                                   build_model)


def n_params(m) -> int:
    return sum(p.numel() for p in m.parameters())


def test_lenet5_shapes_and_size():
    m = LeNet5(1, 28, 28, 10)
    assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert n_params(m) == 61706  # the classic LeNet-5 (28x28 padded like the 32x32 original)
    assert LeNet5(3, 32, 32, 10)(torch.zeros(1, 3, 32, 32)).shape == (1, 10)
    assert LeNet5(1, 8, 8, 10)(torch.zeros(1, 1, 8, 8)).shape == (1, 10)  # sklearn digits


def test_resnet20_shape_and_size():
    m = ResNet20(3, 10)
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert 0.26e6 < n_params(m) < 0.28e6  # He et al.: 0.27M
    assert sum(1 for x in m.modules() if isinstance(x, torch.nn.Conv2d)) == 19  # + 1 dense = 20 layers


def test_hlf_classifier_layers():
    m = HLFClassifier()
    widths = [(x.in_features, x.out_features) for x in m.modules() if isinstance(x, torch.nn.Linear)]
    assert widths == [(14, 50), (50, 20), (20, 10), (10, 3)]
    assert m(torch.zeros(5, 14)).shape == (5, 3)


def test_gru_masks_padded_particles():
    torch.manual_seed(0)
    m = ParticleGRU().eval()
    x = torch.randn(3, 801, 19)
    n = torch.tensor([5, 801, 40])
    out = m(x, n)
    x2 = x.clone()
    x2[0, 5:] = 99.0  # garbage in the padding must not matter
    x2[2, 40:] = -7.0
    assert torch.allclose(m(x2, n), out, atol=1e-6)
    x3 = x.clone()
    x3[0, 4] += 1.0  # a real particle does
    assert not torch.allclose(m(x3, n)[0], out[0])
    assert m.branch.gru.hidden_size == 50 and out.shape == (3, 3)


def test_inclusive_classifier_concatenates_hlf():
    torch.manual_seed(0)
    m = InclusiveClassifier().eval()
    assert (m.fc1.in_features, m.fc1.out_features, m.fc2.out_features) == (50 + 14, 25, 3)
    x, n, h = torch.randn(2, 801, 19), torch.tensor([3, 9]), torch.randn(2, 14)
    out = m(x, n, h)
    h2 = h.clone()
    h2[0, 0] += 5
    assert out.shape == (2, 3) and not torch.allclose(m(x, n, h2)[0], out[0])


@pytest.mark.parametrize("name,shape,classes,inputs,cls", [
    ("lenet5", {"channels": 1, "height": 8, "width": 8}, 10, lambda: (torch.zeros(2, 1, 8, 8),), LeNet5),
    ("resnet20", {"channels": 3}, 10, lambda: (torch.zeros(2, 3, 32, 32),), ResNet20),
    ("hlf", {}, 4, lambda: (torch.zeros(2, 14),), HLFClassifier),
    ("gru", {}, 3, lambda: (torch.zeros(2, 801, 19), torch.tensor([3, 9])), ParticleGRU),
    ("inclusive", {}, 3, lambda: (torch.zeros(2, 801, 19), torch.tensor([3, 9]), torch.zeros(2, 14)),
     InclusiveClassifier),
])
def test_build_model_by_name_gives_that_model_with_the_asked_classes(name, shape, classes, inputs, cls):
    m = build_model(name, classes, shape).eval()
    assert type(m) is cls
    with torch.no_grad():
        assert m(*inputs()).shape == (2, classes)


def test_build_model_uses_the_shape():
    assert n_params(build_model("lenet5", 10, {"channels": 3, "height": 32, "width": 32})) == \
        n_params(LeNet5(3, 32, 32, 10)) != n_params(LeNet5(1, 28, 28, 10))


def test_bn_buffers_are_the_running_statistics_of_every_tracking_normalisation_layer():
    """Found by torch's public attributes (track_running_stats, running_mean/var), no private class."""
    from pipeline.train.algorithms.averaging import bn_buffers

    tracked = [torch.nn.BatchNorm1d(3), torch.nn.BatchNorm2d(4), torch.nn.SyncBatchNorm(5),
               torch.nn.InstanceNorm2d(6, track_running_stats=True), torch.nn.LazyBatchNorm1d()]
    untracked = [torch.nn.BatchNorm1d(3, track_running_stats=False), torch.nn.InstanceNorm1d(2),
                 torch.nn.LayerNorm(7), torch.nn.GroupNorm(2, 4), torch.nn.Linear(3, 3)]
    model = torch.nn.Sequential(*tracked, *untracked)
    want = [b for m in tracked for b in (m.running_mean, m.running_var)]
    got = bn_buffers(model)
    assert [id(b) for b in got] == [id(b) for b in want]


def test_lenet5_bn_normalises_with_its_batch_and_lenet5_stays_as_it_was():
    """E1's model: BatchNorm after each convolution and hidden dense layer, running statistics taken
    from the batch in training mode; plain LeNet-5 keeps its parameters (no BatchNorm entries)."""
    import torch

    from pipeline.train.models import build_model

    plain = build_model("lenet5", 10, {"channels": 1, "height": 28, "width": 28})
    assert not any("bn" in k for k in plain.state_dict())
    bn = build_model("lenet5_bn", 10, {"channels": 1, "height": 28, "width": 28})
    norms = [m for m in bn.modules() if isinstance(m, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d))]
    assert [m.num_features for m in norms] == [6, 16, 120, 84]
    torch.manual_seed(0)
    x = torch.randn(8, 1, 28, 28) * 3 + 1
    bn.train()
    bn(x)
    assert float(norms[0].running_mean.abs().sum()) > 0 and int(norms[0].num_batches_tracked) == 1
    # a batch's output depends on the other samples of the batch in training mode, not in eval mode
    a = bn(x)[:4]
    b = bn(x[:4])
    assert not torch.allclose(a, b)
    bn.eval()
    assert torch.allclose(bn(x)[:4], bn(x[:4]), atol=1e-5)
