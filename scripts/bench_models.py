"""Time training steps of the FedSPC models (a benchmark, not a test).

For each model and setting: build it, run one warm-up step, then time ``--steps``
steps of forward + backward + SGD update on random data through the app's own
training loop (:func:`fedspc_app.training.loop.train_epochs`, so the precision and
memory layout are those of a run), and print a table of parameter count, seconds per
step and images per second.

Examples
--------
    python scripts/bench_models.py cnn resnet34 vgg11 --steps 5
    python scripts/bench_models.py resnet34 --width 0.25 --precision bf16 --channels-last
    python scripts/bench_models.py cnn resnet34 --table --threads 1   # the README's table
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

# Run as a plain script from a checkout, without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedspc_app.core.config import PRECISIONS, WIDTH_MODELS
from fedspc_app.core.errors import ConfigError
from fedspc_app.models.networks import MODEL_NAMES, build_model
from fedspc_app.training.loop import train_epochs
from fedspc_app.training.precision import native_bf16, resolve_precision

# --table: fp32, bf16 autocast, and bf16 with channels-last tensors.
TABLE_SETTINGS = (("fp32", False), ("bf16", False), ("bf16", True))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(
    name: str,
    *,
    device: torch.device,
    steps: int,
    warmup: int,
    batch_size: int,
    image_size: int,
    num_classes: int,
    vit_embed_dim: int = 768,
    width: float = 1.0,
    precision: str = "fp32",
    channels_last: bool = False,
) -> tuple[float, float, float]:
    """Time training steps of one model in one setting.

    Returns (parameters in millions, seconds per step, images per second).
    """
    model = build_model(name, num_classes=num_classes, image_size=image_size, seed=0,
                        vit_embed_dim=vit_embed_dim, width=width).to(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=gen).to(device)
    y = torch.randint(0, num_classes, (batch_size,), generator=gen).to(device)
    trainable = [key for key, _ in model.named_parameters()]

    def run(count: int) -> None:
        train_epochs(model, lambda: iter([(x, y)] * count), epochs=1, trainable=trainable,
                     learning_rate=0.01, momentum=0.9, precision=precision,
                     channels_last=channels_last)

    if warmup:
        run(warmup)
    _sync(device)
    start = time.perf_counter()
    run(steps)
    _sync(device)
    per_step = (time.perf_counter() - start) / steps
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return params, per_step, batch_size / per_step


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "models",
        nargs="*",
        default=["cnn", "resnet34", "vgg11"],
        metavar="MODEL",
        help=f"models to time, among {', '.join(MODEL_NAMES)} (default: cnn resnet34 vgg11)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-classes", type=int, default=100)
    parser.add_argument("--vit-embed-dim", type=int, default=768)
    parser.add_argument("--width", type=float, default=1.0,
                        help=f"model-width of {', '.join(WIDTH_MODELS)} (default 1.0)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--table", action="store_true",
                        help="time every model in fp32, bf16 and bf16 + channels-last")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.models if name not in MODEL_NAMES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODEL_NAMES)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda asked for, but CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    settings = TABLE_SETTINGS if args.table else ((args.precision, args.channels_last),)

    print(
        f"device={args.device} threads={torch.get_num_threads()} batch={args.batch_size} "
        f"image={args.image_size}x{args.image_size} classes={args.num_classes} "
        f"steps={args.steps} (after {args.warmup} warm-up) "
        f"native-bf16={native_bf16(device)}"
    )
    print(f"{'model':<10} {'width':>6} {'precision':>10} {'ch-last':>8} {'params (M)':>10} "
          f"{'s/step':>9} {'images/s':>9}")
    for name in args.models:
        width = args.width if name in WIDTH_MODELS else 1.0
        for precision, channels_last in settings:
            try:
                params, per_step, rate = bench_model(
                    name, device=device, steps=args.steps, warmup=args.warmup,
                    batch_size=args.batch_size, image_size=args.image_size,
                    num_classes=args.num_classes, vit_embed_dim=args.vit_embed_dim,
                    width=width, precision=precision, channels_last=channels_last)
            except ConfigError as error:
                parser.error(str(error))
            shown = resolve_precision(precision, device)
            shown = f"{shown}*" if precision == "auto" else shown
            print(f"{name:<10} {width:>6g} {shown:>10} {'yes' if channels_last else 'no':>8} "
                  f"{params:>10.3f} {per_step:>9.4f} {rate:>9.1f}", flush=True)
    if args.precision == "auto" and not args.table:
        print("* precision = auto, resolved for this device")


if __name__ == "__main__":
    main()
