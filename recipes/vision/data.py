"""The recipes' LightningDataModule: CIFAR-100, scikit-learn's digits, an image folder, or synthetic.

``--data.dataset``:

* ``cifar100`` (the real job's default): torchvision's CIFAR-100 in ``--data.root``, downloaded
  on local rank zero when missing; offline it fails with one line naming the fixes.
* ``digits``: the 1,797 real 8x8 handwritten digits bundled with scikit-learn (10 classes, no
  network), resized to ``--data.image_size`` and repeated to 3 channels; a fixed, stratified,
  seeded split (``--data.val_fraction`` 0.2, ``--data.split_seed`` 0) gives 1,438 training and
  359 validation images.
* ``folder``: your images, torchvision ``ImageFolder`` style: ``DIR/train/<class>/*`` and
  ``DIR/val/<class>/*``, or ``DIR/<class>/*`` split like digits; ``num_classes`` is the number
  of class folders (at least 2). An image file that cannot be read is skipped with a warning
  naming it (no up-front check: it would open every file before the first step).
* ``synthetic``: the deterministic CIFAR-100-shaped stand-in of :mod:`recipes.vision.synthetic` (tests).

``num_classes`` is known after construction; the recipe links it to ``--model.num_classes``.

Training augmentation (``--data.augment``, on by default; validation is never augmented):
cifar100/synthetic: random crop with ``image_size // 8`` padding and horizontal flip; digits:
the same random crop only (translations of up to ``image_size // 8`` pixels; no flip: digits are
not mirror-symmetric); folder: random resized crop (scale 0.35-1) and horizontal flip, while
validation resizes the short side to ``image_size`` and centre-crops. ``--data.auto_augment``
adds AutoAugment (CIFAR-10 policy). Normalisation (per channel, 0..1 scale): CIFAR-100's own
statistics, 0.5/0.22 for synthetic, the training split's mean/std for digits, ImageNet's
(mean 0.485/0.456/0.406, std 0.229/0.224/0.225) for folder.

The training order and each image's augmentation are functions of the run's seed, the epoch and
the index (:mod:`recipes.vision.resume`), whatever ``--data.num_workers``; the training loader is torchdata's
``StatefulDataLoader``, whose state (the epoch's position) Lightning saves in checkpoints, so a run resumed
in the middle of an epoch goes on bit for bit.

Example:
    >>> dm = ImageDataModule(dataset="digits", batch_size=8, image_size=16)
    >>> dm.num_classes
    10
    >>> dm.prepare_data(); dm.setup("fit")
    >>> x, y = next(iter(dm.train_dataloader()))
    >>> x.shape, x.dtype, y.shape, len(dm.train_set), len(dm.val_set)
    (torch.Size([8, 3, 16, 16]), torch.float32, torch.Size([8]), 1438, 359)
"""

from __future__ import annotations

import os
import socket
import warnings
from typing import Any, Callable, Literal, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Subset, default_collate
from typing_extensions import override

from recipes.vision.datasets import (FolderLayout, TensorImages, digits_images, image_folder, require_sklearn_digits,
                                     scan_folder, stratified_split)
from recipes.common.errors import UsageError, check_loader_options
from recipes.vision.resume import EpochSampler, PositionLoader, run_seed, seeded
from recipes.vision.synthetic import SyntheticCIFAR100

__all__ = ["CIFAR100_URL", "DATASETS", "DatasetUnavailableError", "ImageDataModule"]

CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
DATASETS = ("cifar100", "digits", "folder", "synthetic")
# per-channel statistics of the training images (0..1 scale); digits: computed from its split
_STATS = {
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "synthetic": ((0.5, 0.5, 0.5), (0.22, 0.22, 0.22)),
    "folder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet's, for natural photos
}
_DOWNLOAD_TIMEOUT_S = 60.0
_VERIFIED_ROOTS: set[str] = set()  # CIFAR-100 roots checked in this process (the check reads 160 MB)


class DatasetUnavailableError(UsageError):
    """The dataset is neither on disk nor downloadable; the message says where and what to do."""


class _Transformed(Dataset):
    """Apply ``transform`` to the image of each ``(image, label)`` pair of ``base``.

    An image file that cannot be read (``OSError``: not an image, truncated) is skipped: a warning
    names it and counts the skipped files so far (per loader process), and the item is ``None``,
    which :func:`_collate` drops from its batch.
    """

    def __init__(self, base: Dataset, transform: Callable) -> None:
        self.base, self.transform = base, transform
        self.skipped: set[str] = set()

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> Optional[tuple[torch.Tensor, int]]:
        # the training sampler gives (index, augmentation seed): the random transform is a function of it
        index, seed = key if isinstance(key, tuple) else (key, None)
        try:
            image, label = self.base[index]
        except OSError as err:  # PIL's UnidentifiedImageError and "image file is truncated" are OSErrors
            path = _file_of(self.base, index)
            if path not in self.skipped:
                self.skipped.add(path)
                warnings.warn(f"--data.dataset folder: skipped the unreadable image {path} ({err}); "
                              f"{len(self.skipped)} skipped so far. Remove or replace it.", stacklevel=2)
            return None
        return seeded(seed, self.transform, image), label


def _file_of(dataset: Dataset, index: int) -> str:
    """The file behind item ``index`` of an ``ImageFolder`` or a ``Subset`` of one."""
    while isinstance(dataset, Subset):
        dataset, index = dataset.dataset, dataset.indices[index]
    samples = getattr(dataset, "samples", None)
    return samples[index][0] if samples is not None else f"item {index}"


def _collate(batch: list[Optional[tuple[torch.Tensor, int]]]) -> Any:
    """``default_collate`` without the items of unreadable images (:class:`_Transformed`)."""
    kept = [item for item in batch if item is not None]
    if not kept:
        raise UsageError(f"--data.dataset folder: none of the {len(batch)} images of a batch could be read (see the "
                         "warnings naming them): check the image files.")
    return default_collate(kept)


class ImageDataModule(pl.LightningDataModule):
    """CIFAR-100, digits, an image folder or synthetic data, with standard augmentation.

    Args:
        dataset: ``cifar100`` (downloaded into ``root``), ``digits`` (scikit-learn's bundled
            handwritten digits, offline), ``folder`` (your images: ``root/train/<class>/*`` and
            ``root/val/<class>/*``, or ``root/<class>/*`` split by ``val_fraction``) or
            ``synthetic`` (a generated CIFAR-100-shaped stand-in, for tests).
        root: ``cifar100``: the directory holding (or receiving) ``cifar-100-python``;
            ``folder``: the image folder.
        batch_size: samples per device and step; the global batch is this times the number
            of processes (and gradient-accumulation steps).
        image_size: height and width of the images fed to the model (every dataset).
        val_fraction: share of each class held out for validation (digits; a folder without
            ``train/``/``val/``).
        split_seed: seed of that split (same seed, same split everywhere).
        augment: training augmentation: random crop (padding ``image_size // 8``) and
            horizontal flip for cifar100/synthetic, the same crop only (small translations) for
            digits, random resized crop and flip for folder; off: training images are prepared
            like the validation ones.
        num_workers: DataLoader worker processes per device; ``None``: 0 on the CPU (the model
            needs the cores), else ``min(8, cpus // local processes)``.
        auto_augment: add torchvision's AutoAugment (CIFAR-10 policy) to the augmentation.
        download: download CIFAR-100 when it is missing.
        synthetic_train_size: training samples of ``synthetic`` (``None``: 50 000).
        synthetic_val_size: validation samples of ``synthetic`` (``None``: 10 000).
        synthetic_seed: seed of ``synthetic`` (same seed, same data everywhere).

    Raises:
        UsageError: a bad option or (``folder``) a malformed folder, as one line.
    """

    def __init__(
        self,
        dataset: Literal["cifar100", "digits", "folder", "synthetic"] = "cifar100",
        root: str = "data",
        batch_size: int = 128,
        image_size: int = 32,
        val_fraction: float = 0.2,
        split_seed: int = 0,
        augment: bool = True,
        num_workers: Optional[int] = None,
        auto_augment: bool = False,
        download: bool = True,
        synthetic_train_size: Optional[int] = None,
        synthetic_val_size: Optional[int] = None,
        synthetic_seed: int = 0,
    ) -> None:
        super().__init__()
        if dataset not in DATASETS:
            raise UsageError(f"--data.dataset {dataset!r} is not valid; choose one of {list(DATASETS)}.")
        if batch_size < 1:
            raise UsageError(f"--data.batch_size must be >= 1, got {batch_size}.")
        if image_size < 8:
            raise UsageError(f"--data.image_size must be >= 8, got {image_size}.")
        check_loader_options(val_fraction, num_workers)
        self.save_hyperparameters()
        self.dataset = dataset
        self.root = root
        self.batch_size = batch_size
        self.image_size = image_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.augment = augment
        self.num_workers = num_workers
        self.auto_augment = auto_augment
        self.download = download
        self.synthetic_train_size = synthetic_train_size
        self.synthetic_val_size = synthetic_val_size
        self.synthetic_seed = synthetic_seed
        # the folder is checked now: its class count sizes the model head before anything runs
        self.layout: Optional[FolderLayout] = scan_folder(root) if dataset == "folder" else None
        if dataset == "digits":
            require_sklearn_digits()  # fail now, before the model and trainer are built
        self.classes: list[str] = (
            list(self.layout.classes) if self.layout else [str(i) for i in range(10)] if dataset == "digits"
            else [f"class_{i:03d}" for i in range(100)]
        )
        self.num_classes = len(self.classes)
        if self.num_classes < 2:
            raise UsageError(f"--data.root {root!r}: one class folder ({self.classes[0]!r}); a classifier needs at "
                             "least 2 classes: add a folder of images per class.")
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None
        self._stats: tuple[tuple[float, ...], tuple[float, ...]] = _STATS.get(dataset, ((0.0,), (1.0,)))

    # ------------------------------------------------------------------ data on disk
    def _missing_message(self, reason: str) -> str:
        where = os.path.abspath(os.path.join(self.root, "cifar-100-python"))
        return (
            f"CIFAR-100 is not available in {where} (--data.root {self.root!r}): {reason} Fix: put the "
            f"python version ({CIFAR100_URL}, extracted or the .tar.gz) there or point --data.root at its "
            "parent, let this machine reach www.cs.toronto.edu (--data.download true), or train offline "
            "with --data.dataset digits (or folder --data.root DIR)."
        )

    @override
    def prepare_data(self) -> None:
        """Check CIFAR-100 and download it when missing (local rank zero only; no-op otherwise).

        Raises:
            DatasetUnavailableError: the files are missing or corrupt and could not be downloaded.
        """
        root = os.path.abspath(self.root)
        if self.dataset != "cifar100" or root in _VERIFIED_ROOTS:
            return
        from torchvision.datasets import CIFAR100

        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(_DOWNLOAD_TIMEOUT_S)  # an unreachable host must not hang the run
        try:
            for train in (True, False):
                CIFAR100(self.root, train=train, download=self.download)
        except Exception as err:  # URLError, timeouts, md5 mismatch, missing files: one message
            if self.download:
                reason = f"the files are missing or corrupt and the download failed ({type(err).__name__}: {err})."
            else:
                reason = "the files are missing or corrupt and --data.download is false."
            raise DatasetUnavailableError(self._missing_message(reason)) from None
        finally:
            socket.setdefaulttimeout(previous)
        _VERIFIED_ROOTS.add(root)

    # ------------------------------------------------------------------ datasets
    def _transforms(self, train: bool) -> Callable:
        from torchvision.transforms import v2

        size = self.image_size
        steps: list[Any] = [v2.ToImage()]  # PIL (cifar100, folder) or uint8 tensor -> uint8 image
        if self.dataset == "folder":
            if train and self.augment:
                steps += [v2.RandomResizedCrop(size, scale=(0.35, 1.0), antialias=True), v2.RandomHorizontalFlip()]
            else:
                steps += [v2.Resize(size, antialias=True), v2.CenterCrop(size)]
        else:
            if self.dataset == "cifar100" and size != 32:
                steps.append(v2.Resize(size, antialias=True))
            if train and self.augment:
                steps.append(v2.RandomCrop(size, padding=size // 8))
                if self.dataset != "digits":  # a mirrored digit is not the same digit
                    steps.append(v2.RandomHorizontalFlip())
        if train and self.augment and self.auto_augment:
            steps.append(v2.AutoAugment(v2.AutoAugmentPolicy.CIFAR10))
        mean, std = self._stats
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
        return v2.Compose(steps)

    def _datasets(self) -> tuple[Dataset, Dataset]:
        if self.dataset == "synthetic":
            kw = {"image_size": self.image_size, "seed": self.synthetic_seed}
            return (SyntheticCIFAR100(train=True, size=self.synthetic_train_size, **kw),
                    SyntheticCIFAR100(train=False, size=self.synthetic_val_size, **kw))
        if self.dataset == "digits":
            images, labels = digits_images(self.image_size)  # (N, 3, S, S) uint8, (N,)
            train_idx, val_idx = stratified_split(labels, self.val_fraction, self.split_seed)
            pixels = images[train_idx, 0].double() / 255  # (n_train, S, S): the 3 channels are equal
            self._stats = ((pixels.mean().item(),) * 3, (pixels.std().item(),) * 3)
            return TensorImages(images, labels, train_idx), TensorImages(images, labels, val_idx)
        if self.dataset == "folder":
            layout = self.layout
            assert layout is not None  # set in __init__ for folder
            if layout.val_dir is not None:
                return image_folder(layout.train_dir, layout.classes), image_folder(layout.val_dir, layout.classes)
            full = image_folder(layout.train_dir, layout.classes)
            train_idx, val_idx = stratified_split(full.targets, self.val_fraction, self.split_seed)
            return Subset(full, train_idx), Subset(full, val_idx)
        from torchvision.datasets import CIFAR100

        try:
            return CIFAR100(self.root, train=True, download=False), CIFAR100(self.root, train=False, download=False)
        except RuntimeError:
            raise DatasetUnavailableError(self._missing_message("the files are missing or corrupt.")) from None

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        train, val = self._datasets()
        if len(train) < self.batch_size:  # type: ignore[arg-type]
            raise UsageError(f"--data.batch_size {self.batch_size} is larger than the {len(train)} training images "
                             f"of --data.dataset {self.dataset}: lower it (the last partial batch is dropped).")
        self.train_set = _Transformed(train, self._transforms(train=True))
        self.val_set = _Transformed(val, self._transforms(train=False))

    def _workers(self) -> int:
        if self.num_workers is not None:
            return self.num_workers
        trainer = self.trainer
        if trainer is None or type(trainer.accelerator).__name__ == "CPUAccelerator":
            return 0
        local = max(1, trainer.num_devices)
        return min(8, (os.cpu_count() or 1) // local)

    def _loader(self, dataset: Optional[Dataset], train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("ImageDataModule: call setup() before asking for a dataloader.")
        workers = self._workers()
        kwargs: dict[str, Any] = dict(batch_size=self.batch_size, num_workers=workers, persistent_workers=workers > 0,
                                      pin_memory=torch.cuda.is_available(), collate_fn=_collate)
        if not train:
            return DataLoader(dataset, shuffle=False, **kwargs)  # Lightning adds a DistributedSampler under DDP
        # the order and augmentation are functions of (seed, epoch, index); the loader's state (the sampler's
        # position) is saved in checkpoints by Lightning, so a resume mid-epoch goes on bit for bit
        # (recipes.vision.resume); the sampler splits the data over the processes itself (Lightning keeps a
        # DistributedSampler as it is, and sets its epoch)
        trainer = self.trainer
        place = (trainer.distributed_sampler_kwargs if trainer is not None else None) or {}
        sampler = EpochSampler(len(dataset), run_seed(), place.get("num_replicas", 1),  # type: ignore[arg-type]
                               place.get("rank", 0))
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which torch now says is deprecated
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            return PositionLoader(dataset, sampler=sampler, drop_last=True, **kwargs)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)
