"""Time a Dirichlet partition of Tiny-ImageNet's size (100,000 training images in 200
classes) over 10 clients, for a few alphas: ``python scripts/bench_partition.py``."""

from __future__ import annotations

import argparse
import time

import numpy as np

from fedspc_app.data.partition import dirichlet_partition


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.01, 0.1, 1.0])
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    train = rng.permutation(np.repeat(np.arange(200), 500))
    test = rng.permutation(np.repeat(np.arange(200), 50))
    for alpha in args.alphas:
        started = time.perf_counter()
        partition = dirichlet_partition(train, test, num_clients=args.clients, alpha=alpha,
                                        seed=0)
        seconds = time.perf_counter() - started
        print(f"alpha {alpha:<5g} {seconds:6.3f} s  ({partition.tries} tries, "
              f"{sum(a.size for a in partition.train_indices)} training images)")


if __name__ == "__main__":
    main()
