"""LRA's Image task: CIFAR-10 in grayscale as 1024 pixel tokens (Tay et al. 2021, Sec. 3),
and Fashion-MNIST (Xiao et al. 2017) as 784 pixel tokens, the offline stand-in.

Shape letters: S images, H x W pixels, T = H * W tokens.

* CIFAR-10, the python release ``cifar-10-batches-py/``: ``data_batch_1`` .. ``data_batch_5``
  and ``test_batch``, each a pickled dict with ``b"data"`` uint8 ``[10000, 3072]`` (the red,
  green and blue 32 x 32 planes of an image, row-major, one after another) and
  ``b"labels"`` (10,000 ints in 0..9). Grayscale as LRA computes it with TensorFlow:
  ``tf.image.rgb_to_grayscale`` (weights 0.2989, 0.5870, 0.1140 on the image scaled to
  [0, 1], in float32) then ``convert_image_dtype`` back to uint8 (multiply by 255.5,
  truncate).
* Fashion-MNIST, the IDX files ``{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz`` that
  Debian's ``dataset-fashion-mnist`` package installs in ``/usr/share/datasets/
  fashion-mnist``: big-endian headers (magic ``0x00000803`` with three dimensions for
  images, ``0x00000801`` with one for labels), then uint8 data. Gzipped or not.

Splits as LRA's image pipeline: train = the first 90 % of the training images, val = the
last 10 %, test = the test set. Pixel values are the tokens (vocabulary 256).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from flarepp.data.base import DataError
from flarepp.data.lra.base import LRADataset, LRASplit, TokenSequences, load_data_pickle, missing

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
GRAY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], np.float32)  # tf.image.rgb_to_grayscale
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = "test_batch"


def rgb_to_gray(rgb_SHW3: np.ndarray) -> np.ndarray:
    """uint8 RGB -> uint8 gray exactly as TensorFlow's ``rgb_to_grayscale`` (docstring)."""
    gray = (rgb_SHW3.astype(np.float32) * np.float32(1.0 / 255.0)) @ GRAY_WEIGHTS
    return np.minimum(gray * np.float32(255.5), 255).astype(np.uint8)


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One python-release batch: grayscale ``[S, 32, 32]`` uint8 and labels ``[S]``."""
    if not path.is_file():
        raise missing(path, "CIFAR-10 batch", "Download cifar-10-python.tar.gz from "
                      "https://www.cs.toronto.edu/~kriz/cifar.html and unpack it; pass the "
                      "cifar-10-batches-py folder")
    batch = load_data_pickle(path, encoding="bytes")
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"{path}: expected a dict with keys b'data' and b'labels', got "
                        f"{sorted(batch) if isinstance(batch, dict) else type(batch).__name__}")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 \
            or len(labels) != len(data):
        raise DataError(f"{path}: b'data' must be uint8 [S, 3072] with S labels, got "
                        f"{data.dtype} {list(data.shape)} and {len(labels)} labels")
    rgb = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return rgb_to_gray(rgb), labels


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzipped or not) as a uint8 array of its declared shape."""
    if not path.is_file():
        gz = path.with_name(path.name + ".gz")
        if gz.is_file():
            path = gz
        else:
            raise missing(path, "IDX file", "On Debian or Ubuntu: `apt-get install "
                          "dataset-fashion-mnist` (installs /usr/share/datasets/fashion-mnist)"
                          "; or download the four files from "
                          "https://github.com/zalandoresearch/fashion-mnist")
    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path}: not an unsigned-byte IDX file (magic bytes {raw[:4]!r})")
    ndim = raw[3]
    shape = tuple(int(v) for v in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise DataError(f"{path}: header declares shape {list(shape)} "
                        f"({int(np.prod(shape))} bytes) but holds {data.size} data bytes")
    return data.reshape(shape)


def image_dataset(task: str, train: tuple[np.ndarray, np.ndarray],
                  test: tuple[np.ndarray, np.ndarray], source: str,
                  val_fraction: float = 0.1) -> LRADataset:
    """Images ``[S, H, W]`` uint8 with labels as pixel-token splits, val = the last
    ``val_fraction`` of the training images (LRA's ``train[90%:]``)."""
    (x_train, y_train), (x_test, y_test) = train, test
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(f"{source}: train images {list(x_train.shape[1:])} and test images "
                        f"{list(x_test.shape[1:])} differ in size")
    cut = round(len(x_train) * (1.0 - val_fraction))
    tokens = int(np.prod(x_train.shape[1:]))

    def split(x: np.ndarray, y: np.ndarray) -> LRASplit:
        return LRASplit((TokenSequences.from_padded(x.reshape(len(x), tokens)),),
                        np.asarray(y, dtype=np.int64))

    splits = {"train": split(x_train[:cut], y_train[:cut]),
              "val": split(x_train[cut:], y_train[cut:]), "test": split(x_test, y_test)}
    classes = int(max(y_train.max(), y_test.max())) + 1
    return LRADataset(task, splits, vocab_size=256, num_classes=classes, max_length=tokens,
                      source=source, facts={"image_shape": list(x_train.shape[1:])}).validate()


def load_cifar10(root: str | Path) -> LRADataset:
    """The CIFAR-10 python release under ``root`` (``cifar-10-batches-py`` or its parent)."""
    root = Path(root)
    if not (root / CIFAR_TEST).exists() and (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    parts = [read_cifar_batch(root / name) for name in CIFAR_TRAIN]
    train = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    return image_dataset("image", train, read_cifar_batch(root / CIFAR_TEST), str(root))


def load_fashion_mnist(root: str | Path = FASHION_MNIST_DIR) -> LRADataset:
    """Fashion-MNIST's four IDX files under ``root`` (default: where Debian installs them)."""
    root = Path(root)

    def part(prefix: str) -> tuple[np.ndarray, np.ndarray]:
        images = read_idx(root / f"{prefix}-images-idx3-ubyte")
        labels = read_idx(root / f"{prefix}-labels-idx1-ubyte").astype(np.int64)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(f"{root}: {prefix} images {list(images.shape)} and labels "
                            f"{list(labels.shape)} should be [S, H, W] and [S]")
        return images, labels

    return image_dataset("image", part("train"), part("t10k"), str(root))


__all__ = ["FASHION_MNIST_DIR", "image_dataset", "load_cifar10", "load_fashion_mnist",
           "read_cifar_batch", "read_idx", "rgb_to_gray"]
