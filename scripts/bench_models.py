"""Time training steps of the FedSPC models (a benchmark, not a test).

For each model: build it, run one warm-up step, then time ``--steps`` steps of
forward + backward + SGD update on random data, and print a table of parameter count,
seconds per step and images per second.

Example
-------
    python scripts/bench_models.py cnn resnet34 vgg11 --device cpu --steps 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

# Run as a plain script from a checkout, without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedspc_app.core.models import MODEL_NAMES, build_model


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
    vit_embed_dim: int,
) -> tuple[float, float, float]:
    """Time training steps of one model.

    Parameters
    ----------
    name : str
        Model name, one of :data:`fedspc_app.core.models.MODEL_NAMES`.
    device : torch.device
        Where to run.
    steps, warmup : int
        Number of timed steps, and of untimed steps before them.
    batch_size, image_size, num_classes : int
        Shape of the random batch and number of classes.
    vit_embed_dim : int
        Embedding width of ``vit``.

    Returns
    -------
    tuple of float
        (parameters in millions, seconds per step, images per second).
    """
    model = build_model(
        name,
        num_classes=num_classes,
        image_size=image_size,
        seed=0,
        vit_embed_dim=vit_embed_dim,
    ).to(device)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=gen).to(device)
    y = torch.randint(0, num_classes, (batch_size,), generator=gen).to(device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
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
    args = parser.parse_args(argv)
    unknown = [name for name in args.models if name not in MODEL_NAMES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODEL_NAMES)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda asked for, but CUDA is not available")
    device = torch.device(args.device)

    print(
        f"device={args.device} threads={torch.get_num_threads()} batch={args.batch_size} "
        f"image={args.image_size}x{args.image_size} classes={args.num_classes} "
        f"steps={args.steps} (after {args.warmup} warm-up)"
    )
    print(f"{'model':<10} {'params (M)':>10} {'s/step':>10} {'images/s':>10}")
    for name in args.models:
        params, per_step, rate = bench_model(
            name,
            device=device,
            steps=args.steps,
            warmup=args.warmup,
            batch_size=args.batch_size,
            image_size=args.image_size,
            num_classes=args.num_classes,
            vit_embed_dim=args.vit_embed_dim,
        )
        print(f"{name:<10} {params:>10.3f} {per_step:>10.4f} {rate:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
