"""Image datasets as tensors: our own IDX reader (Fashion-MNIST from Debian's
`dataset-fashion-mnist`), CIFAR-10's python-pickle batches from a user-given directory,
and scikit-learn's bundled `load_digits` for fast tests. Nothing is downloaded."""
from __future__ import annotations

import gzip
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from unbroken.split.errors import SplitInputError

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = "test_batch"
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


@dataclass(frozen=True)
class Split:
    """Train and validation features (float32, flattened, standardized) and labels (int64)."""
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    n_classes: int
    name: str

    @property
    def n_features(self) -> int:
        return int(self.x_train.shape[1])


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (optionally gzipped) as an array of its declared type and shape."""
    path = Path(path)
    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise SplitInputError(f"{path} is not an IDX file (bad magic number); give the original "
                              "*-idx?-ubyte(.gz) files")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    count = int(np.prod(dims)) if dims else 0
    body = raw[4 + 4 * ndim:]
    if len(body) != count * dtype.itemsize:
        raise SplitInputError(f"{path} is truncated: header says {dims}, file holds {len(body)} bytes")
    return np.frombuffer(body, dtype=dtype).reshape(dims)


def _standardize(x_train: np.ndarray, x_val: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    x_train = x_train.reshape(len(x_train), -1).astype(np.float32)
    x_val = x_val.reshape(len(x_val), -1).astype(np.float32)
    mean, std = x_train.mean(), x_train.std() + 1e-6  # one scalar pair: pixels share a scale
    return torch.from_numpy((x_train - mean) / std), torch.from_numpy((x_val - mean) / std)


def _make(name, x_train, y_train, x_val, y_val, n_classes) -> Split:
    xt, xv = _standardize(x_train, x_val)
    return Split(xt, torch.from_numpy(np.asarray(y_train, dtype=np.int64)), xv,
                 torch.from_numpy(np.asarray(y_val, dtype=np.int64)), n_classes, name)


def fashion_mnist(root: str | Path = FASHION_DIR) -> Split:
    """Fashion-MNIST from its IDX files (train 60k, validation = the 10k test set)."""
    root = Path(root)
    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte")
    paths = []
    for n in names:
        found = [p for p in (root / f"{n}.gz", root / n) if p.exists()]
        if not found:
            raise SplitInputError(f"Fashion-MNIST file {n}(.gz) not found in {root}; install it with "
                                  "`apt-get install -y dataset-fashion-mnist` or pass --data-dir")
        paths.append(found[0])
    xt, yt, xv, yv = (read_idx(p) for p in paths)
    return _make("fashion-mnist", xt, yt, xv, yv, 10)


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")  # the format is a pickle: only load a directory you trust
    data, labels = d.get(b"data", d.get("data")), d.get(b"labels", d.get("labels"))
    if data is None or labels is None:
        raise SplitInputError(f"{path} has no data/labels: it is not a CIFAR-10 python batch")
    return np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32), np.asarray(labels, dtype=np.int64)


def cifar10(root: str | Path) -> Split:
    """CIFAR-10 from the python-pickle batches (cifar-10-batches-py) in `root`."""
    root = Path(root)
    if not root.is_dir():
        raise SplitInputError(f"CIFAR-10 directory {root} does not exist; download and unpack "
                              "cifar-10-python.tar.gz yourself and pass its cifar-10-batches-py directory")
    missing = [n for n in (*CIFAR_TRAIN, CIFAR_TEST) if not (root / n).is_file()]
    if missing:
        raise SplitInputError(f"CIFAR-10 directory {root} lacks {', '.join(missing)}; pass the unpacked "
                              "cifar-10-batches-py directory")
    parts = [_cifar_batch(root / n) for n in CIFAR_TRAIN]
    xv, yv = _cifar_batch(root / CIFAR_TEST)
    return _make("cifar10", np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                 xv, yv, 10)


def digits(val_share: float = 0.2, seed: int = 0) -> Split:
    """scikit-learn's bundled 8x8 digits (1797 images), a seeded train/validation split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SplitInputError("--dataset digits needs scikit-learn: pip install scikit-learn (or the test "
                              "extra: pip install -e '.[test]')") from None

    d = load_digits()
    order = np.random.default_rng(seed).permutation(len(d.target))
    n_val = int(len(order) * val_share)
    val, train = order[:n_val], order[n_val:]
    return _make("digits", d.data[train], d.target[train], d.data[val], d.target[val], 10)


def load(name: str, data_dir: str | Path | None = None) -> Split:
    """A dataset by name: fashion-mnist, cifar10 (needs data_dir), digits."""
    if name == "fashion-mnist":
        return fashion_mnist(data_dir or FASHION_DIR)
    if name == "cifar10":
        if data_dir is None:
            raise SplitInputError("cifar10 needs --data-dir DIR (the unpacked cifar-10-batches-py directory); "
                                  "nothing is downloaded")
        return cifar10(data_dir)
    if name == "digits":
        return digits()
    raise SplitInputError(f"unknown dataset {name!r}; choose fashion-mnist, cifar10 or digits")
