import torch
from torch import nn

from multigpu.network import NUM_BLOCKS, resnet50_blocks


def test_network_is_stem_sixteen_bottlenecks_and_head():
    net = resnet50_blocks(num_classes=10)
    assert isinstance(net, nn.Sequential) and len(net) == NUM_BLOCKS == 18
    assert [type(block).__name__ for block in net[1:17]] == ["Bottleneck"] * 16
    assert isinstance(net[-1][-1], nn.Linear) and net[-1][-1].out_features == 10
    assert sum(p.numel() for p in net.parameters()) == sum(p.numel() for block in net for p in block.parameters())


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
    from multigpu.model import ResNet50Classifier

    torch.manual_seed(0)
    plain = ResNet50Classifier().eval()
    torch.manual_seed(0)
    fast = ResNet50Classifier(channels_last=True).eval()
    for model in (plain, fast):
        model.configure_model()
    assert fast.net[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-4, atol=1e-4)
