"""Write a CIFAR-100-shaped dataset of random images in the standard python layout.

For checks on machines without the real data (a lent GPU machine has no internet):
``<out>/cifar-100-python/{train,test,meta}`` pickles with uint8 images and 100 fine
labels, read by the project's real loader (``dataset = "cifar100"``,
``data-dir = <out>``, ``download = false``). The images are noise, so accuracy means
nothing; speed and memory do::

    python scripts/synthetic_cifar.py /tmp/synthetic --train 50000 --test 10000
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import numpy as np

CLASSES = 100


def write(out: Path, train: int, test: int, seed: int = 0) -> Path:
    folder = Path(out) / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, count in (("train", train), ("test", test)):
        data = rng.integers(0, 256, size=(count, 3 * 32 * 32), dtype=np.uint8)
        labels = (np.arange(count) % CLASSES).tolist()  # every class equally often
        with (folder / name).open("wb") as handle:
            pickle.dump({"data": data, "fine_labels": labels}, handle, protocol=4)
    with (folder / "meta").open("wb") as handle:
        pickle.dump({"fine_label_names": [f"class{i}" for i in range(CLASSES)]},
                    handle, protocol=4)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=50000)
    parser.add_argument("--test", type=int, default=10000)
    args = parser.parse_args(argv)
    print(write(args.out, args.train, args.test))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
