"""The one training loop: divergence guard, bfloat16 autocast, channels-last."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fedspc_app.core.errors import DivergenceError
from fedspc_app.models.networks import build_model
from fedspc_app.training import precision as precision_module
from fedspc_app.training.loop import evaluate_model, train_epochs


def batches(count: int = 6, size: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    data = [(torch.randn(size, 3, 32, 32, generator=generator),
             torch.randint(0, 10, (size,), generator=generator)) for _ in range(count)]
    return lambda: iter(data)


def model() -> nn.Module:
    return build_model("cnn", num_classes=10, in_chans=3, image_size=32, seed=1)


def train(net: nn.Module, **options):
    trainable = [name for name, _ in net.named_parameters()]
    return train_epochs(net, batches(), epochs=2, trainable=trainable, learning_rate=0.05,
                        **options)


def torch_sgd(net: nn.Module, **options) -> float:
    """The steps of ``train`` with torch.optim.SGD, reading each loss at once; the
    summed loss in step order."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, **options)
    net.train()
    total = 0.0
    for _ in range(2):
        for images, labels in batches()():
            loss = nn.functional.cross_entropy(net(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * labels.shape[0]
    return total


def test_the_losses_are_read_per_epoch_and_summed_in_step_order():
    result = train(model())
    assert (result.steps, result.examples) == (12, 96)
    # The same steps reading each loss at once: the same sum, bit for bit.
    assert result.loss_sum == torch_sgd(model())


def test_a_non_finite_loss_names_its_step():
    net = model()
    poisoned = list(batches()())
    poisoned[3] = (torch.full_like(poisoned[3][0], float("nan")), poisoned[3][1])
    with pytest.raises(DivergenceError, match="at step 4"):
        train_epochs(net, lambda: iter(poisoned), epochs=1,
                     trainable=[n for n, _ in net.named_parameters()], learning_rate=0.05)


def test_bf16_autocast_trains_close_to_fp32_and_keeps_float32_parameters():
    reference = train(model())
    net = model()
    result = train(net, precision="bf16")
    assert result.loss_sum != reference.loss_sum  # the forward really ran in bfloat16
    assert result.loss_sum == pytest.approx(reference.loss_sum, rel=0.05)
    assert all(p.dtype == torch.float32 for p in net.parameters())
    correct, examples, loss_sum = evaluate_model(net, batches()(), precision="bf16")
    correct32, examples32, loss_sum32 = evaluate_model(net, batches()())
    assert examples == examples32 == 48
    assert loss_sum != loss_sum32 and loss_sum == pytest.approx(loss_sum32, rel=0.05)
    assert abs(correct - correct32) <= 2


def test_channels_last_gives_the_fp32_result_and_converts_the_model():
    reference_net = model()
    reference = train(reference_net)
    net = model()
    result = train(net, channels_last=True)
    assert result.loss_sum == pytest.approx(reference.loss_sum, rel=1e-4)
    conv = next(p for p in net.parameters() if p.dim() == 4)
    assert conv.is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(net.parameters(), reference_net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        train(model(), precision="fp16")



@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_is_bf16_only_where_the_device_has_it_natively(monkeypatch, native):
    monkeypatch.setattr(precision_module, "native_bf16", lambda device: native)
    expected = train(model(), precision="bf16" if native else "fp32")
    assert train(model(), precision="auto").loss_sum == expected.loss_sum
    net = model()
    assert evaluate_model(net, batches()(), precision="auto") == evaluate_model(
        net, batches()(), precision="bf16" if native else "fp32")


@pytest.mark.parametrize("native", [True, False])
def test_the_run_records_the_resolved_precision_and_warns_once_for_emulated_bf16(
        monkeypatch, native):
    from fedspc_app import server_app
    from fedspc_app.core.config import parse_run_config

    monkeypatch.setattr(precision_module, "native_bf16", lambda device: native)
    logged = []
    monkeypatch.setattr(server_app, "log", lambda level, *args: logged.append((level, args)))
    auto = server_app.run_precision(parse_run_config({"precision": "auto", "device": "cpu"}),
                                    deployment=False)
    assert auto == {"setting": "auto", "resolved": "bf16" if native else "fp32",
                    "device": "cpu", "native-bf16": native}
    assert not logged
    forced = server_app.run_precision(parse_run_config({"precision": "bf16", "device": "cpu"}),
                                      deployment=False)
    assert forced["resolved"] == "bf16"
    warnings = [args for level, args in logged if level == logging.WARNING]
    assert len(warnings) == (0 if native else 1)
    if warnings:
        assert "is emulated there and slower than fp32" in warnings[0][1]
    assert server_app.describe_precision(auto, channels_last=True) == (
        f"{'bf16' if native else 'fp32'} (auto) + channels-last")


def test_fp32_on_cuda_turns_tf32_off_and_says_so():
    """PyTorch lets cuDNN run float32 convolutions in TF32; fp32 here means fp32."""
    from fedspc_app.training.loop import autocast

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
        autocast(torch.device("cpu"), "fp32")
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
        autocast(torch.device("cuda"), "fp32")
        assert not torch.backends.cudnn.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    assert precision_module.precision_report("fp32", "cuda")["tf32"] is False
    assert "tf32" not in precision_module.precision_report("fp32", "cpu")


def test_each_supernode_resolves_auto_for_its_own_device():
    from fedspc_app import server_app
    from fedspc_app.core.config import parse_run_config

    report = server_app.run_precision(parse_run_config({"precision": "auto"}), deployment=True)
    assert report["setting"] == "auto" and report["resolved"].startswith("per SuperNode")
    assert server_app.run_precision(parse_run_config({"precision": "bf16"}),
                                    deployment=True)["resolved"] == "bf16"


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.0, 5e-4),
                                                    (0.9, 5e-4)])
def test_the_loop_s_sgd_is_torch_s_sgd_bit_for_bit(momentum, weight_decay):
    net, reference = model(), model()
    result = train(net, momentum=momentum, weight_decay=weight_decay)
    assert result.loss_sum == torch_sgd(reference, momentum=momentum,
                                        weight_decay=weight_decay)
    for a, b in zip(net.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(a, b)


def test_a_frozen_parameter_is_left_alone_and_its_momentum_starts_when_it_trains():
    net = model()
    head = {k: v.clone() for k, v in net.state_dict().items() if k.startswith("head.")}
    body = [name for name, _ in net.named_parameters() if not name.startswith("head.")]
    train_epochs(net, batches(), epochs=1, trainable=body, learning_rate=0.05, momentum=0.9)
    for key, value in head.items():
        assert torch.equal(net.state_dict()[key], value)


class Scalar(nn.Module):
    """f(x) = w x with w = 1: loss (w x - y)^2 / 2 on x = 1, y = 0 is w^2 / 2."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.w * x


def test_a_finite_blow_up_over_the_divergence_factor_names_its_step():
    """lr = 3: w <- w - 3 w = -2 w each step, so the step losses are 0.5, 2, 8, 32, 128:
    step 5 is the first over 100 x max(1, 0.5) = 100."""
    one = [(torch.ones(1), torch.zeros(1))] * 6

    def half_squared(out, y):
        return ((out - y) ** 2).mean() / 2

    def run(factor):
        net = Scalar()
        return train_epochs(net, lambda: iter(one), epochs=1, trainable=["w"],
                            learning_rate=3.0, loss_fn=half_squared, divergence_factor=factor)

    with pytest.raises(DivergenceError, match=r"loss 128 at step 5, over 100 times .* 0\.5"):
        run(100.0)
    with pytest.raises(DivergenceError, match="at step 4"):
        run(16.0)  # 32 > 16
    result = run(0.0)  # the finiteness check only: all six steps, 0.5 * 4^k
    assert result.steps == 6 and result.loss_sum == sum(0.5 * 4.0**k for k in range(6))
