"""Images for the diffusion example: scikit-learn's handwritten digits (the default) or a
folder with one subfolder per class, a seeded batch iterator that prepares batches on a
background thread, the small classifier that judges the samples, and the pictures of a run
(the loss curve, a grid of samples).

Images are float32 [N, C, S, S] in [-1, 1] (the range the samplers clip their guesses of
``x0`` to); labels are int64 class indices.

The digits are 8x8 with values 0..16. They are upsampled with bilinear interpolation rather
than nearest: nearest turns each pixel into a flat 4x4 block whose hard edges are a texture
the model would have to learn and that no handwriting has, while bilinear gives smooth
strokes. Nothing is lost for the quality check: real and generated images reach the
classifier through the same area downsampling back to 8x8.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import flame as fl


class DataError(ValueError):
    """A dataset that cannot be used, with what was found and what was expected."""


@dataclass
class Dataset:
    images: np.ndarray  # float32 [N, C, S, S] in [-1, 1]
    labels: np.ndarray  # int64 [N]
    classes: list[str]

    @property
    def channels(self) -> int:
        return self.images.shape[1]

    @property
    def image_size(self) -> int:
        return self.images.shape[2]

    def subset(self, indices) -> Dataset:
        return Dataset(self.images[indices], self.labels[indices], self.classes)


# --- loading ----------------------------------------------------------------------------------


def _resize(plane: np.ndarray, size: int, resample) -> np.ndarray:
    """One float image plane resized with Pillow (mode "F": no rounding to 8 bits)."""
    from PIL import Image

    return np.asarray(Image.fromarray(plane.astype(np.float32)).resize((size, size), resample))


def load_digits(image_size: int = 32) -> Dataset:
    """scikit-learn's 1,797 digits, bilinearly upsampled to ``image_size``, one channel."""
    from PIL import Image
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    planes = digits.images.astype(np.float32) / 16.0 * 2.0 - 1.0
    resized = np.stack([_resize(plane, image_size, Image.Resampling.BILINEAR) for plane in planes])
    images = np.clip(resized, -1.0, 1.0)[:, None]
    return Dataset(images, digits.target.astype(np.int64), [str(k) for k in range(10)])


def _image_files(folder: Path) -> list[Path]:
    from PIL import Image

    known = {suffix.lower() for suffix in Image.registered_extensions()}
    files = [path for path in sorted(folder.rglob("*")) if path.is_file()]
    return [
        path for path in files if path.suffix.lower() in known and not path.name.startswith(".")
    ]


def _read_image(path: Path, image_size: int, channels: int) -> np.ndarray:
    """``path`` as [C, S, S] in [-1, 1]: converted to grayscale or RGB whatever its mode
    (palette, alpha, CMYK), centre-cropped to a square, then resized."""
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("L" if channels == 1 else "RGB")
        width, height = image.size
        side = min(width, height)
        left, top = (width - side) // 2, (height - side) // 2
        image = image.crop((left, top, left + side, top + side))
        image = image.resize((image_size, image_size), Image.Resampling.LANCZOS)
        array = np.asarray(image, dtype=np.float32).reshape(image_size, image_size, channels)
    return array.transpose(2, 0, 1) / 127.5 - 1.0


def load_folder(root, image_size: int = 32, channels: int = 1) -> Dataset:
    """A folder with one subfolder per class (its name is the class's; sorted, as
    torchvision's ImageFolder), the images in any format Pillow reads."""
    root = Path(root)
    if channels not in (1, 3):
        raise DataError(f"--channels must be 1 (grayscale) or 3 (RGB), got {channels}")
    if not root.is_dir():
        raise DataError(f"data folder {root} does not exist or is not a folder")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    files = {name: _image_files(root / name) for name in classes}
    if not any(files.values()):
        loose = _image_files(root)
        hint = (f" ({len(loose)} images lie directly in it: put them in one subfolder per "
                "class)" if loose else "")  # fmt: skip
        raise DataError(
            f"no images found in {root}{hint}; expected {root}/<class name>/<image file> "
            f"with one subfolder per class ({len(classes)} subfolders found)"
        )
    images, labels, unreadable = [], [], []
    for label, name in enumerate(classes):
        for path in files[name]:
            try:
                images.append(_read_image(path, image_size, channels))
                labels.append(label)
            except Exception as error:  # Pillow raises several kinds for a broken file
                unreadable.append(f"{path} ({type(error).__name__}: {error})")
    if unreadable:
        shown = "\n  ".join(unreadable[:20])
        more = f"\n  ... and {len(unreadable) - 20} more" if len(unreadable) > 20 else ""
        noun = "file" if len(unreadable) == 1 else "files"
        raise DataError(f"{len(unreadable)} unreadable image {noun} in {root}:\n  {shown}{more}")
    return Dataset(np.stack(images).astype(np.float32), np.array(labels, np.int64), classes)


def held_out_split(data: Dataset, fraction: float = 0.1, seed: int = 0) -> tuple[Dataset, Dataset]:
    """``(train, held_out)``: a seeded random ``fraction`` of each class held out, so the
    quality check sees every class even in a small folder."""
    rng = np.random.default_rng(seed)
    held = []
    for label in range(len(data.classes)):
        members = np.flatnonzero(data.labels == label)
        count = int(round(len(members) * fraction)) if len(members) > 1 else 0
        held.extend(rng.permutation(members)[:count].tolist())
    mask = np.zeros(len(data.labels), dtype=bool)
    mask[held] = True
    return data.subset(np.flatnonzero(~mask)), data.subset(np.flatnonzero(mask))


# --- batches ----------------------------------------------------------------------------------


class BatchLoader:
    """Endless shuffled batches of a dataset as FLAME tensors ``(images, labels)``, this
    rank's share of each epoch (``rank`` of ``world_size``; one process: everything).

    Each epoch's order comes from a ``DistributedSampler`` (PyTorch's permutation, seeded by
    ``seed + epoch`` through ``set_epoch``, alike on every rank; rank r takes every
    ``world_size``-th index from r, the tail that does not divide among the ranks dropped);
    the last, partial batch of a rank's share is dropped so that every step has the same
    shapes. Global batch k of an epoch is positions ``[k*g, (k+1)*g)`` of the permutation,
    ``g = batch_size * world_size``, whatever the world size. A background thread slices
    the batches and copies them to FLAME (the current backend when the loader was made) up
    to ``prefetch`` batches ahead, so the copy overlaps the step.

    ``state_dict()`` is the position of the next batch: the epoch, and how many images of it
    every rank together has been handed (plus this loader's batch index, for reading). A
    loader given it hands out the same batches from there on, in a world of any size (a
    position between two of its global batches rounds back to the earlier one)."""

    def __init__(self, data: Dataset, batch_size: int, seed: int = 0, prefetch: int = 2,
                 rank: int = 0, world_size: int = 1):  # fmt: skip
        from flame.utils.data import DistributedSampler

        count = len(data.labels)
        self.sampler = DistributedSampler(range(count), num_replicas=world_size, rank=rank,
                                          seed=seed, drop_last=True)  # fmt: skip
        if len(self.sampler) < batch_size:
            where = f"the {count} training images"
            if world_size > 1:
                where = f"a rank's share of {where} ({len(self.sampler)} with {world_size} ranks)"
            raise DataError(f"batch size {batch_size} is larger than {where}")
        self.data, self.batch_size, self.prefetch = data, batch_size, prefetch
        self.world_size = world_size
        self.batches_per_epoch = len(self.sampler) // batch_size
        self.backend = fl.get_backend()
        self._position = {"epoch": 0, "batch": 0, "images": 0}
        self._thread = None
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()

    def state_dict(self) -> dict:
        return dict(self._position)

    def load_state_dict(self, state: dict) -> None:
        """A position saved by a loader of any world size. (A state of the earlier format,
        with the epoch's generator state, continues its epoch in the sampler's order.)"""
        self.close()
        epoch, batch = int(state["epoch"]), int(state["batch"])
        images = int(state.get("images", batch * self.batch_size))
        batch = min(images // (self.batch_size * self.world_size), self.batches_per_epoch)
        self._position = self._at(epoch, batch)

    def _at(self, epoch: int, batch: int) -> dict:
        if batch >= self.batches_per_epoch:
            epoch, batch = epoch + 1, 0
        images = batch * self.batch_size * self.world_size
        return {"epoch": epoch, "batch": batch, "images": images}

    def __iter__(self):
        return self

    def __next__(self) -> tuple[fl.Tensor, fl.Tensor]:
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._position, images, labels = item
        return images, labels

    def _start(self) -> None:
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.prefetch)
        start = dict(self._position)
        self._thread = threading.Thread(target=self._produce, args=(start,), daemon=True)
        self._thread.start()

    def _produce(self, start: dict) -> None:
        try:
            with fl.backend(self.backend):  # the backend is a context variable: per thread
                self._batches(start)
        except BaseException as error:  # handed to the consumer, raised there
            self._put(error)

    def _batches(self, start: dict) -> None:
        epoch, first = start["epoch"], start["batch"]
        size = self.batch_size
        while not self._stop.is_set():
            self.sampler.set_epoch(epoch)
            order = np.array(list(self.sampler), dtype=np.int64)
            for index in range(first, self.batches_per_epoch):
                chosen = order[index * size : (index + 1) * size]
                images = fl.tensor(self.data.images[chosen]).realize()
                labels = fl.tensor(self.data.labels[chosen]).realize()
                if not self._put((self._at(epoch, index + 1), images, labels)):
                    return
            epoch, first = epoch + 1, 0

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop the background thread (batches it prepared are dropped; the position is
        that of the last batch handed out)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


# --- the quality check ------------------------------------------------------------------------


def features(images: np.ndarray, size: int = 8) -> np.ndarray:
    """Images [N, C, S, S] as the classifier's inputs: area-averaged to ``size`` x ``size``
    per channel (the digits' own resolution) and flattened."""
    from PIL import Image

    count, channels = images.shape[:2]
    planes = images.reshape(count * channels, *images.shape[2:])
    small = np.stack([_resize(plane, size, Image.Resampling.BOX) for plane in planes])
    return small.reshape(count, channels * size * size)


def fit_classifier(data: Dataset):
    """An RBF support-vector classifier of the real training images (about 99% on the
    held-out digits): a judge independent of the diffusion model, and quick to fit."""
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC

    classifier = make_pipeline(StandardScaler(), SVC(C=10.0, gamma="scale"))
    classifier.fit(features(data.images), data.labels)
    return classifier


def _diversity(images: np.ndarray) -> float:
    """The mean distance of a set of images to their mean (a collapse to one image is 0)."""
    if len(images) < 2:
        return 0.0
    flat = images.reshape(len(images), -1)
    return float(np.linalg.norm(flat - flat.mean(0), axis=1).mean())


def quality_report(classifier, samples: np.ndarray, sample_labels: np.ndarray,
                   train: Dataset, held_out: Dataset) -> dict:  # fmt: skip
    """How often the classifier gives the class a sample was conditioned on, overall and
    per class, next to the classifier's accuracy on real held-out images; per class also
    the labels it gave and the samples' spread beside the real images' spread."""
    predicted = classifier.predict(features(samples))
    report = {
        "agreement": float(np.mean(predicted == sample_labels)),
        "samples": int(len(sample_labels)),
        "classifier_heldout_accuracy": None,
        "heldout_images": int(len(held_out.labels)),
        "per_class": {},
    }
    if len(held_out.labels):
        real = classifier.predict(features(held_out.images))
        report["classifier_heldout_accuracy"] = float(np.mean(real == held_out.labels))
    for label, name in enumerate(train.classes):
        mine = sample_labels == label
        if not mine.any():
            continue
        given, counts = np.unique(predicted[mine], return_counts=True)
        report["per_class"][name] = {
            "agreement": float(np.mean(predicted[mine] == label)),
            "predicted": {train.classes[g]: int(c) for g, c in zip(given, counts)},
            "spread": _diversity(samples[mine]),
            "real_spread": _diversity(train.images[train.labels == label]),
        }
    values = [entry["agreement"] for entry in report["per_class"].values()]
    report["per_class_agreement_min"] = float(min(values)) if values else None
    report["per_class_agreement_max"] = float(max(values)) if values else None
    return report


# --- pictures ---------------------------------------------------------------------------------


def plot_losses(losses: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=120)
    steps = np.arange(1, len(losses) + 1)
    axes.plot(steps, losses, color="0.75", linewidth=0.8, label="per step")
    window = max(1, min(100, len(losses) // 10))
    if len(losses) >= window:
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        axes.plot(steps[window - 1 :], smooth, color="C0", label=f"mean of {window}")
    axes.set(xlabel="step", ylabel="MSE loss", yscale="log", title="diffusion training loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_samples(images: np.ndarray, columns: int, classes: list, path: Path) -> None:
    """A grid of ``images`` ([rows * columns, C, S, S] in [-1, 1]), one row per class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count, channels, size, _ = images.shape
    rows = count // columns
    tiles = ((images + 1.0) / 2.0).clip(0, 1).transpose(0, 2, 3, 1)
    grid = np.ones((rows * (size + 1) + 1, columns * (size + 1) + 1, channels), np.float32)
    for index, tile in enumerate(tiles):
        row, column = divmod(index, columns)
        top, left = 1 + row * (size + 1), 1 + column * (size + 1)
        grid[top : top + size, left : left + size] = tile
    figure, axes = plt.subplots(figsize=(columns * 0.6 + 1, rows * 0.6 + 0.6), dpi=100)
    axes.imshow(grid[..., 0] if channels == 1 else grid, cmap="gray", vmin=0, vmax=1,
                interpolation="nearest")  # fmt: skip
    axes.set_yticks([1 + row * (size + 1) + size / 2 for row in range(rows)], classes[:rows])
    axes.set_xticks([])
    axes.set_title("samples (EMA weights), one row per class", fontsize=9)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
