import pytest
import torch
import torchvision
from torch import nn
from torchvision.models.resnet import Bottleneck

from multigpu.model.resnet import NUM_BLOCKS, resnet50_blocks


def test_network_is_stem_sixteen_bottlenecks_in_halves_and_head():
    net = resnet50_blocks(num_classes=10)
    assert isinstance(net, nn.Sequential) and len(net) == NUM_BLOCKS == 34
    assert [type(block).__name__ for block in net[1:33]] == ["BottleneckEntry", "BottleneckExit"] * 16
    assert isinstance(net[-1][-1], nn.Linear) and net[-1][-1].out_features == 10
    assert (
        sum(p.numel() for p in net.parameters())
        == sum(p.numel() for p in torchvision.models.resnet50().parameters()) - (7 * 7 - 3 * 3) * 3 * 64 - 990 * 2049
    )  # torchvision's: its 7x7 stem and 1000 classes


@pytest.mark.parametrize("index", [1, 3, 31])  # with a downsampling shortcut, without, the last
def test_the_two_halves_of_a_bottleneck_compute_torchvisions_bottleneck(index):
    net = resnet50_blocks().train()
    entry, exit_ = net[index], net[index + 1]
    inplanes, width = entry.conv1.in_channels, exit_.conv3.out_channels
    reference = Bottleneck(inplanes, width // 4, entry.conv2.stride[0], exit_.downsample).train()
    reference.load_state_dict({**entry.state_dict(), **exit_.state_dict()})
    x = torch.randn(4, inplanes, 8, 8)
    assert torch.equal(exit_(entry(x)), reference(x))


def test_cifar_stem_keeps_resolution_and_imagenet_stem_downsamples():
    x = torch.randn(2, 3, 32, 32)
    cifar, imagenet = resnet50_blocks(stem="cifar"), resnet50_blocks(stem="imagenet")
    assert cifar[0](x).shape == (2, 64, 32, 32)
    assert imagenet[0](x).shape == (2, 64, 8, 8)
    assert cifar.eval()(x).shape == imagenet.eval()(x).shape == (2, 10)


def test_blocks_applied_one_by_one_equal_the_whole_network():
    net = resnet50_blocks().eval()
    x = torch.randn(2, 3, 32, 32)
    out = x
    for block in net:
        out = block(out)
    torch.testing.assert_close(out, net(x))


def test_channels_last_model_keeps_the_format_and_the_result():
    from multigpu.model.classifier import ImageClassifier

    torch.manual_seed(0)
    plain = ImageClassifier().eval()
    torch.manual_seed(0)
    fast = ImageClassifier(channels_last=True).eval()
    for model in (plain, fast):
        model.configure_model()
    assert fast.net[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-4, atol=1e-4)
