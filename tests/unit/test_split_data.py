"""The split application's data: our IDX reader, CIFAR-10's pickle batches (a tiny generated
directory in the real format), digits; one-line errors for missing or malformed input."""
import gzip
import pickle
import struct

import numpy as np
import pytest

from unbroken.split import data
from unbroken.split.errors import SplitInputError


def _idx(path, arr: np.ndarray, *, gz: bool) -> None:
    raw = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_roundtrip(tmp_path, gz):
    arr = np.random.default_rng(0).integers(0, 256, (5, 3, 4), dtype=np.uint8)
    p = tmp_path / ("x.gz" if gz else "x")
    _idx(p, arr, gz=gz)
    assert np.array_equal(data.read_idx(p), arr)


def test_idx_bad_magic_and_truncation(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(SplitInputError, match="not an IDX file"):
        data.read_idx(tmp_path / "bad")
    arr = np.zeros((4, 2), dtype=np.uint8)
    _idx(tmp_path / "short", arr, gz=False)
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-3])
    with pytest.raises(SplitInputError, match="truncated"):
        data.read_idx(tmp_path / "short")


def test_fashion_mnist_layout_from_idx_files(tmp_path):
    rng = np.random.default_rng(1)
    _idx(tmp_path / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (12, 28, 28)), gz=True)
    _idx(tmp_path / "train-labels-idx1-ubyte.gz", np.arange(12) % 10, gz=True)
    _idx(tmp_path / "t10k-images-idx3-ubyte", rng.integers(0, 256, (4, 28, 28)), gz=False)
    _idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(4), gz=False)
    s = data.fashion_mnist(tmp_path)
    assert s.x_train.shape == (12, 784) and s.x_val.shape == (4, 784) and s.n_classes == 10
    assert s.y_train.tolist() == [i % 10 for i in range(12)]
    assert abs(float(s.x_train.mean())) < 1e-4  # standardized with the training set's statistics


def test_fashion_mnist_missing_names_the_package(tmp_path):
    with pytest.raises(SplitInputError, match="apt-get install -y dataset-fashion-mnist"):
        data.fashion_mnist(tmp_path)


def _cifar_dir(root, per_batch=3):
    rng = np.random.default_rng(2)
    root.mkdir()
    for name in (*data.CIFAR_TRAIN, data.CIFAR_TEST):
        batch = {b"batch_label": name.encode(), b"labels": list(rng.integers(0, 10, per_batch)),
                 b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)}
        with open(root / name, "wb") as f:
            pickle.dump(batch, f)
    return root


def test_cifar10_reads_the_python_batches(tmp_path):
    root = _cifar_dir(tmp_path / "cifar-10-batches-py")
    s = data.cifar10(root)
    assert s.x_train.shape == (15, 3072) and s.x_val.shape == (3, 3072)
    with open(root / "data_batch_2", "rb") as f:
        assert s.y_train[3:6].tolist() == [int(v) for v in pickle.load(f, encoding="bytes")[b"labels"]]


def test_cifar10_missing_directory_or_batch_is_one_line(tmp_path):
    with pytest.raises(SplitInputError, match="does not exist; download and unpack"):
        data.load("cifar10", tmp_path / "nope")
    with pytest.raises(SplitInputError, match="needs --data-dir"):
        data.load("cifar10")
    root = _cifar_dir(tmp_path / "c")
    (root / "data_batch_3").unlink()
    with pytest.raises(SplitInputError, match="lacks data_batch_3"):
        data.cifar10(root)


def test_digits_split_is_seeded():
    a, b = data.digits(seed=3), data.digits(seed=3)
    assert a.x_train.shape[1] == 64 and len(a.y_val) == int(1797 * 0.2)
    assert a.y_train.tolist() == b.y_train.tolist()
