"""The recipe's LightningDataModule: CIFAR-100 (torchvision) or the offline synthetic stand-in.

Example:
    >>> dm = CifarDataModule(dataset="synthetic", batch_size=8, synthetic_train_size=64)
    >>> dm.prepare_data(); dm.setup("fit")
    >>> x, y = next(iter(dm.train_dataloader()))
    >>> x.shape, x.dtype, y.shape
    (torch.Size([8, 3, 32, 32]), torch.float32, torch.Size([8]))
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Literal, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from recipes.synthetic import SyntheticCIFAR100

__all__ = ["CifarDataModule", "DatasetUnavailableError", "CIFAR100_URL"]

CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
# per-channel statistics of the training images (0..1 scale)
_STATS = {
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "synthetic": ((0.5, 0.5, 0.5), (0.22, 0.22, 0.22)),
}
_DOWNLOAD_TIMEOUT_S = 60.0


class DatasetUnavailableError(RuntimeError):
    """The dataset is neither on disk nor downloadable; the message says where and what to do."""


class _Transformed(Dataset):
    """Apply ``transform`` to the image of each ``(image, label)`` pair of ``base``."""

    def __init__(self, base: Dataset, transform: Callable) -> None:
        self.base, self.transform = base, transform

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.base[index]
        return self.transform(image), label


class CifarDataModule(pl.LightningDataModule):
    """CIFAR-100 (downloaded into ``root``) or ``synthetic`` data, with the standard augmentation.

    Args:
        dataset: ``cifar100`` (torchvision, downloaded on local rank zero into ``root``) or
            ``synthetic`` (:class:`recipes.synthetic.SyntheticCIFAR100`: offline,
            deterministic, learnable, CIFAR-100 shaped).
        root: directory holding (or receiving) ``cifar-100-python``.
        batch_size: samples per device and step; the global batch is this times the number
            of processes (and gradient-accumulation steps).
        num_workers: DataLoader worker processes per device; ``None``: 0 on the CPU (the model
            needs the cores), else ``min(8, cpus // local processes)``.
        auto_augment: add torchvision's AutoAugment (CIFAR-10 policy) to the random crop
            (padding 4) and horizontal flip.
        download: download CIFAR-100 when it is missing.
        synthetic_train_size: training samples of ``synthetic`` (``None``: 50 000).
        synthetic_val_size: validation samples of ``synthetic`` (``None``: 10 000).
        synthetic_seed: seed of ``synthetic`` (same seed, same data everywhere).
    """

    def __init__(
        self,
        dataset: Literal["cifar100", "synthetic"] = "cifar100",
        root: str = "data",
        batch_size: int = 128,
        num_workers: Optional[int] = None,
        auto_augment: bool = False,
        download: bool = True,
        synthetic_train_size: Optional[int] = None,
        synthetic_val_size: Optional[int] = None,
        synthetic_seed: int = 0,
    ) -> None:
        super().__init__()
        if dataset not in _STATS:
            raise ValueError(f"--data.dataset {dataset!r} is not valid; choose one of {list(_STATS)}.")
        if batch_size < 1:
            raise ValueError(f"--data.batch_size must be >= 1, got {batch_size}.")
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"--data.num_workers must be >= 0 or None (auto), got {num_workers}.")
        self.save_hyperparameters()
        self.dataset = dataset
        self.root = root
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.auto_augment = auto_augment
        self.download = download
        self.synthetic_train_size = synthetic_train_size
        self.synthetic_val_size = synthetic_val_size
        self.synthetic_seed = synthetic_seed
        self.num_classes = 100
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None
        self._prepared = False

    # ------------------------------------------------------------------ data on disk
    def _missing_message(self, reason: str) -> str:
        where = os.path.abspath(os.path.join(self.root, "cifar-100-python"))
        return (
            f"CIFAR-100 is not available: {reason}\n"
            f"  looked in: {where} (from --data.root {self.root!r})\n"
            "  fixes:\n"
            f"    - put CIFAR-100 there: the python version, {CIFAR100_URL} (extracted, or the .tar.gz in --data.root),\n"
            "      or point --data.root at the directory that holds cifar-100-python/\n"
            "    - or allow this machine to reach www.cs.toronto.edu and rerun (--data.download true)\n"
            "    - or train offline on the built-in stand-in: --data.dataset synthetic"
        )

    @override
    def prepare_data(self) -> None:
        """Check CIFAR-100 and download it when missing (local rank zero only; no-op for synthetic).

        Raises:
            DatasetUnavailableError: the files are missing or corrupt and could not be downloaded.
        """
        if self.dataset != "cifar100" or self._prepared:
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
        self._prepared = True

    # ------------------------------------------------------------------ datasets
    def _transforms(self, train: bool) -> Callable:
        from torchvision.transforms import v2

        mean, std = _STATS[self.dataset]
        steps: list[Any] = [v2.ToImage()]
        if train:
            steps += [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()]
            if self.auto_augment:
                steps.append(v2.AutoAugment(v2.AutoAugmentPolicy.CIFAR10))
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
        return v2.Compose(steps)

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        if self.dataset == "synthetic":
            train = SyntheticCIFAR100(train=True, size=self.synthetic_train_size, seed=self.synthetic_seed)
            val = SyntheticCIFAR100(train=False, size=self.synthetic_val_size, seed=self.synthetic_seed)
        else:
            from torchvision.datasets import CIFAR100

            try:
                train = CIFAR100(self.root, train=True, download=False)
                val = CIFAR100(self.root, train=False, download=False)
            except RuntimeError:
                raise DatasetUnavailableError(self._missing_message("the files are missing or corrupt.")) from None
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
            raise RuntimeError("CifarDataModule: call setup() before asking for a dataloader.")
        workers = self._workers()
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,  # Lightning swaps in a DistributedSampler (shuffling as asked) under DDP
            drop_last=train,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)
