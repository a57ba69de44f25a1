"""What makes the image recipe's resume bit for bit: data order, augmentation and step randomness as functions of counters.

A run resumed from a checkpoint taken in the middle of an epoch must see exactly the batches, the
augmented images and the dropout masks the uninterrupted run saw. Nothing here draws from a
random stream whose position a resume would lose; each draw is a function of the run's seed
(:func:`run_seed`) and of counters that the checkpoint holds:

* :class:`EpochSampler`: the training order of epoch ``e`` is a permutation seeded by ``(seed, e)``,
  split over the processes as ``DistributedSampler`` splits it (Lightning keeps it: it is one);
  each index comes with its augmentation seed, a function of ``(seed, e, index)``, which
  :func:`seeded` applies around the sample's transform, so neither the DataLoader's worker
  count nor a resume changes an augmented image;
  the sampler's position (``state_dict``/``load_state_dict``) is part of the state of torchdata's
  ``StatefulDataLoader``, which Lightning saves in checkpoints and restores, so a resumed sampler
  skips the indices taken, without loading them; :class:`PositionLoader` restores that position
  alone when the run resumes with another worker count, whose loader state torchdata cannot load;
* :class:`EpochPosition`: the resumed epoch's batch counter follows the sampler's position, so a
  resume with another batch size trains the epoch's remaining images, no fewer;
* :class:`StepSeed`: before each training batch, the global torch generators (CPU and CUDA:
  dropout, drop-path) are seeded by ``(seed, rank, epoch, batch index)``, so a step's randomness
  does not depend on what ran before it (validation, a DataLoader started, a resume).

Example:
    >>> sampler = EpochSampler(10, seed=0)
    >>> sampler.set_epoch(3)
    >>> first = list(sampler)
    >>> len(first), sorted(i for i, _ in first) == list(range(10))
    (10, True)
    >>> sampler.load_state_dict({"epoch": 3, "taken": 4})
    >>> list(sampler) == first[4:]
    True
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterator, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

__all__ = ["EpochPosition", "EpochSampler", "PositionLoader", "StepSeed", "mix", "run_seed", "seeded"]

_MASK = (1 << 64) - 1


def mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 over each): nearby inputs give unrelated seeds.

    Example:
        >>> mix(0, 1) != mix(1, 0) and 0 <= mix(0, 1) < 2**63
        True
    """
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 31
    return h >> 1


def run_seed() -> int:
    """The run's seed: ``seed_everything``'s (``PL_GLOBAL_SEED``), else torch's initial seed.

    Example:
        >>> saved = os.environ.pop("PL_GLOBAL_SEED", None)
        >>> _ = torch.manual_seed(123); run_seed()
        123
        >>> os.environ["PL_GLOBAL_SEED"] = "7"; run_seed()  # as pl.seed_everything(7) sets it
        7
        >>> _ = os.environ.pop("PL_GLOBAL_SEED") if saved is None else os.environ.update(PL_GLOBAL_SEED=saved)
    """
    seed = os.environ.get("PL_GLOBAL_SEED")
    return int(seed) if seed is not None else torch.initial_seed()


def seeded(seed: Optional[int], fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn(value)`` with torch's CPU generator seeded by ``seed`` and restored afterwards (``None``: as is).

    torchvision's random transforms draw from the global CPU generator; seeding it per sample makes
    the sample's augmentation a function of ``seed`` alone, and restoring it leaves the stream of
    the rest of the process (the model's dropout when loading runs in the main process) untouched.

    Example:
        >>> before = torch.get_rng_state()
        >>> a, b = seeded(5, lambda n: torch.rand(n), 3), seeded(5, lambda n: torch.rand(n), 3)
        >>> torch.equal(a, b), torch.equal(torch.get_rng_state(), before)
        (True, True)
    """
    if seed is None:
        return fn(value)
    with torch.random.fork_rng(devices=[]):  # the CPU generator only: CUDA's is the step's
        torch.default_generator.manual_seed(seed)
        return fn(value)


class EpochSampler(DistributedSampler):
    """Shuffled ``(index, augmentation seed)`` pairs, whose position is saved and restored by the loader.

    Epoch ``e``'s order is a permutation seeded by ``(seed, e)``, padded (``drop_last=False``) with its
    own first indices to a multiple of ``num_replicas``; process ``rank`` takes every
    ``num_replicas``-th index from ``rank``, as ``DistributedSampler`` does (Lightning keeps it: it is
    one, and calls :meth:`set_epoch`). :meth:`state_dict` is the epoch and the indices this process
    has taken in it; torchdata's ``StatefulDataLoader`` puts it in its own state (which Lightning saves
    in checkpoints and gives back on resume), and :meth:`load_state_dict` starts the next iteration
    after them.

    Args:
        length: the dataset's size.
        seed: the run's seed.
        num_replicas: processes sharing the data.
        rank: this process.

    Example:
        >>> ranks = [EpochSampler(5, seed=0, num_replicas=2, rank=r) for r in (0, 1)]
        >>> [len(s) for s in ranks], sorted({i for s in ranks for i, _ in s})
        ([3, 3], [0, 1, 2, 3, 4])
    """

    def __init__(self, length: int, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        if length < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"EpochSampler: need length >= 1 and 0 <= rank < num_replicas, got {length}, "
                             f"{rank}, {num_replicas}")
        # not DistributedSampler.__init__: it needs a dataset and may ask torch.distributed
        self.length, self.seed, self.num_replicas, self.rank = length, seed, num_replicas, rank
        self.shuffle, self.drop_last, self.epoch = True, False, 0
        self.num_samples = math.ceil(length / num_replicas)  # per process and epoch
        self.total_size = self.num_samples * num_replicas
        self._start: Optional[int] = None  # a loaded position: the next iteration starts there
        self._taken = 0  # indices of the current iteration taken so far
        self._iter_epoch = 0  # the epoch of the current iteration

    def order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s permutation of all indices, padded to ``total_size``."""
        g = torch.Generator().manual_seed(mix(self.seed, epoch))
        perm = torch.randperm(self.length, generator=g).tolist()
        while len(perm) < self.total_size:
            perm += perm[: self.total_size - len(perm)]
        return perm

    @override
    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        # a generator: the epoch and position are read at the first draw, after Lightning's set_epoch
        epoch, start = self.epoch, self._start or 0
        self._start, self._iter_epoch, self._taken = None, epoch, start
        for i in self.order(epoch)[self.rank:: self.num_replicas][start:]:
            self._taken += 1
            yield i, mix(self.seed, epoch, i)

    @override
    def __len__(self) -> int:
        return self.num_samples  # the whole epoch's, also when resuming: Lightning counts the batches taken

    @override
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._start = None  # a position belongs to its epoch: another one starts at its beginning
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "taken"}``: the epoch and the indices of it this process has taken."""
        if self._start is not None:  # loaded, not iterated yet
            return {"epoch": self.epoch, "taken": self._start}
        return {"epoch": self._iter_epoch, "taken": self._taken}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Go on from :meth:`state_dict`'s position: the next iteration skips the indices taken."""
        self.epoch, self._start = int(state["epoch"]), int(state["taken"])


class StepSeed(Callback):
    """Seed torch's generators (CPU and every CUDA device) before each training batch.

    The seed is a function of the run's seed, the process's rank, the epoch and the batch index,
    so dropout and drop-path masks are the same in a resumed run as in the uninterrupted one,
    whatever consumed random numbers between two steps.

    Example:
        >>> StepSeed().seed is None  # Trainer(callbacks=[StepSeed()]); on_fit_start reads the run's seed
        True
    """

    def __init__(self) -> None:
        self.seed: Optional[int] = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seed = run_seed()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        seed = self.seed if self.seed is not None else run_seed()
        torch.manual_seed(mix(seed, trainer.global_rank, trainer.current_epoch, batch_idx))


def _main_state(state: dict[str, Any]) -> dict[str, Any]:
    """The main process's part of a ``StatefulDataLoader`` state (a multi-process loader keeps it in its snapshot)."""
    return (state.get("_snapshot") or {}).get("_main_snapshot") or state


def _position(state: dict[str, Any]) -> Optional[dict[str, int]]:
    """The :class:`EpochSampler` state inside a ``StatefulDataLoader`` state (``None``: none there)."""
    return (_main_state(state).get("_sampler_iter_state") or {}).get("sampler_state")


class PositionLoader(StatefulDataLoader):
    """torchdata's ``StatefulDataLoader`` that resumes a state saved with another ``num_workers``.

    The state of a single-process loader and that of a multi-process one are different structures, and
    torchdata asserts on the other one. What decides the data is the sampler's position alone (the order
    and each image's augmentation are functions of the seed, the epoch and the index, not of the worker
    that loads it), so a state of another worker count restores that position into the sampler and
    starts the loader afresh from it.
    """

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = _main_state(state_dict).get("_num_workers", 0)  # the single-process state does not say: 0
        position = _position(state_dict)
        if state_dict and saved != self.num_workers and position is not None:
            super().load_state_dict({})
            self.sampler.load_state_dict(position)  # type: ignore[attr-defined]
            return
        super().load_state_dict(state_dict)


class EpochPosition(Callback):
    """On resume, the epoch's batch counter is the one the sampler's position gives at this run's batch size.

    Lightning ends an epoch when its batch counter reaches the loader's length; it restores the counter
    of the checkpoint's batch size. After ``--data.batch_size`` 8 -> 16, 5 batches in, the sampler goes on
    from image 40 while Lightning counts 5 of the 89 batches of 16 done: it would stop 3 batches before the
    images run out. The counter becomes ``N // b - (N - taken) // b`` (``N``: this process's images an
    epoch, ``b``: the new batch size), so the images left are exactly the batches left; unchanged for the
    same batch size.
    """

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        saved = (checkpoint.get("datamodule_hyper_parameters") or {}).get("batch_size")
        data = trainer.datamodule
        batch = getattr(data, "batch_size", None)
        fit = (checkpoint.get("loops") or {}).get("fit_loop") or {}
        loaders = (fit.get("state_dict") or {}).get("combined_loader") or []
        position = _position(loaders[0]) if len(loaders) == 1 else None
        progress = fit.get("epoch_loop.batch_progress")
        if saved in (None, batch) or position is None or progress is None or data.train_set is None:
            return
        place = trainer.distributed_sampler_kwargs or {}
        images = math.ceil(len(data.train_set) / place.get("num_replicas", 1))  # EpochSampler.num_samples
        shift = images // batch - (images - position["taken"]) // batch - progress["current"]["ready"]
        for counts in (progress["current"], progress["total"]):
            for key in counts:
                counts[key] = max(0, counts[key] + shift)
