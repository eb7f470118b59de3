"""checks/gpu_benchmark.py's MFU: the FLOPs of a training image as torch's FlopCounterMode counts
them (counted on the meta device), against a real forward and backward on the CPU and against a
count by hand of VGG16's layers; the MFU its figures give is images/s x those FLOPs / the peak."""
import gpu_benchmark
import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from src.models import build_model


def test_the_meta_count_is_flop_counter_modes_of_a_real_forward_and_backward():
    """SqueezeNet 1.1 at 64 px: the count train_flops uses (meta device, no arithmetic) is what
    FlopCounterMode counts around one image's real forward and backward on the CPU."""
    torch.manual_seed(0)
    model = build_model("squeezenet1_1", "none").eval()
    image = torch.randn(1, 3, 64, 64)
    with FlopCounterMode(display=False) as forward:
        model(image)
    with FlopCounterMode(display=False) as both:
        model(image).sum().backward()
    assert gpu_benchmark.train_flops("squeezenet1_1", 64) == (forward.get_total_flops(), both.get_total_flops())
    assert forward.get_total_flops() > 0


def test_vgg16_counts_three_forwards_but_the_first_layers_input_gradient():
    """VGG16 at 224 px, counted by hand from its layers: a convolution's forward is 2 x its output
    elements x (input channels x 3 x 3) FLOPs, a Linear's 2 x in x out; the backward computes each
    layer's weight gradient and its input's gradient, each as many FLOPs as the forward, but the
    first convolution's input (the image) needs none. So forward and backward is 3x the forward
    less the first convolution's forward: about 3x (the MFU counted 1.5x: the multiply-adds)."""
    with torch.device("meta"):
        model = build_model("vgg16", "none").eval()
    shapes = {}
    for layer in model.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            layer.register_forward_hook(lambda layer, args, out: shapes.__setitem__(layer, out.shape))
    model(torch.empty(1, 3, 224, 224, device="meta"))
    by_hand = [2 * shape.numel() * layer.in_channels * layer.kernel_size[0] * layer.kernel_size[1]
               if isinstance(layer, nn.Conv2d) else 2 * layer.in_features * layer.out_features
               for layer, shape in shapes.items()]
    forward, both = gpu_benchmark.train_flops("vgg16", 224)
    assert forward == sum(by_hand)
    assert both == 3 * forward - by_hand[0]
    assert both / forward == pytest.approx(3, abs=3 * by_hand[0] / forward)


def test_the_mfu_is_images_per_second_times_the_counted_flops_over_the_peak():
    history = [{"seconds": 50.0, "train_seconds": 40.0, "val_seconds": 10.0, "train_samples": 20000,
                "data_wait_seconds": 4.0, "val_acc": 0.9}]
    _, flops = gpu_benchmark.train_flops("vgg16", 224)
    figures = gpu_benchmark.leg_figures(history, 989e12, flops)
    assert figures["train images/s"] == 500.0
    assert figures["MFU"] == pytest.approx(500.0 * flops / 989e12, rel=1e-12)
    assert gpu_benchmark.leg_figures(history, None, flops)["MFU"] is None
