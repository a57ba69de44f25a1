"""recipes.vision.resume: the image data's order, augmentation and step randomness as functions of counters, so a run
resumed in the middle of an epoch sees what the uninterrupted run saw; the position travels in torchdata's
StatefulDataLoader state (which Lightning saves)."""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.images import write_images
from recipes.vision.data import ImageDataModule
from torchdata.stateful_dataloader import StatefulDataLoader

from recipes.vision.resume import EpochSampler, StepSeed


@pytest.fixture(autouse=True)
def _run_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # as seed_everything(0): the run's seed, whatever torch's stream


def test_an_epochs_order_is_a_permutation_fixed_by_seed_and_epoch() -> None:
    a, b = EpochSampler(50, seed=3), EpochSampler(50, seed=3)
    a.set_epoch(2), b.set_epoch(2)
    first = list(a)
    assert first == list(b) == list(a)  # the same (seed, epoch): the same pairs, however often iterated
    assert sorted(i for i, _ in first) == list(range(50))
    b.set_epoch(3)
    assert [i for i, _ in b] != [i for i, _ in first]
    other = EpochSampler(50, seed=4)
    other.set_epoch(2)
    assert [i for i, _ in other] != [i for i, _ in first]
    seeds = [s for _, s in first]
    assert len(set(seeds)) == 50  # every sample its own augmentation seed


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_resumed_sampler_gives_each_process_the_rest_of_its_epoch(replicas: int) -> None:
    batch, taken = 4, 3  # 3 batches of 4 per process taken before the checkpoint
    full = []
    for rank in range(replicas):
        s = EpochSampler(37, seed=0, num_replicas=replicas, rank=rank)
        s.set_epoch(5)
        full.append(list(s))
    # as DistributedSampler: disjoint shares of equal length covering the data (padded with its first indices)
    assert all(len(f) == len(full[0]) == EpochSampler(37, 0, replicas, 0).__len__() for f in full)
    covered = [i for f in full for i, _ in f]
    assert sorted(set(covered)) == list(range(37)) and len(covered) == -(-37 // replicas) * replicas
    for rank in range(replicas):
        s = EpochSampler(37, seed=0, num_replicas=replicas, rank=rank)
        s.load_state_dict({"epoch": 5, "taken": taken * batch})
        assert list(s) == full[rank][taken * batch:]
        assert list(s) == full[rank]  # once: the next iteration is the epoch's whole again


class _Keys(torch.utils.data.Dataset):
    """Each item is the sampler's key, ``(index, augmentation seed)``."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, int]:
        return key


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_the_stateful_loader_saves_the_samplers_position_and_resumes_after_it(workers: int) -> None:
    def loader() -> StatefulDataLoader:
        sampler = EpochSampler(40, seed=0, num_replicas=2, rank=1)
        sampler.set_epoch(1)
        return StatefulDataLoader(_Keys(), sampler=sampler, batch_size=4, drop_last=True, num_workers=workers)

    first = loader()
    it = iter(first)
    taken = [next(it) for _ in range(3)]
    state = first.state_dict()
    rest = list(it)
    assert len(taken) + len(rest) == 5  # 20 indices of this process, batches of 4
    resumed = loader()
    resumed.load_state_dict(state)
    again = list(resumed)
    assert [b[0].tolist() for b in again] == [b[0].tolist() for b in rest]  # the indices
    assert [b[1].tolist() for b in again] == [b[1].tolist() for b in rest]  # and their augmentation seeds
    assert len(list(resumed)) == 5  # the next epoch starts at its beginning


def test_a_position_belongs_to_its_epoch() -> None:
    sampler = EpochSampler(10, seed=0)
    sampler.load_state_dict({"epoch": 2, "taken": 10})  # saved at epoch 2's end
    assert sampler.state_dict() == {"epoch": 2, "taken": 10}
    sampler.set_epoch(3)  # as Lightning does when the next epoch starts
    assert len(list(sampler)) == 10 and sampler.state_dict() == {"epoch": 3, "taken": 10}


def _datamodule(dataset: str, tmp_path: Path, **kw) -> ImageDataModule:
    root = "data"
    if dataset == "folder":
        for c in ("a", "b"):
            write_images(tmp_path / c, 20, colour=100 if c == "a" else 200)
        root = str(tmp_path)
    dm = ImageDataModule(dataset=dataset, root=root, batch_size=4, image_size=16, synthetic_train_size=64,
                         synthetic_val_size=8, **kw)
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("dataset", ["digits", "synthetic", "folder"])
def test_a_data_module_resumed_mid_epoch_gives_the_uninterrupted_batches(dataset: str, tmp_path: Path) -> None:
    dm = _datamodule(dataset, tmp_path)
    loader = dm.train_dataloader()
    assert isinstance(loader, StatefulDataLoader) and isinstance(loader.sampler, EpochSampler)
    loader.sampler.set_epoch(1)
    torch.manual_seed(0)
    it = iter(loader)
    uninterrupted = [next(it) for _ in range(6)]
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)
    it = iter(loader)
    [next(it) for _ in range(2)]
    state = loader.state_dict()

    resumed_loader = _datamodule(dataset, tmp_path).train_dataloader()
    resumed_loader.load_state_dict(state)
    resumed_loader.sampler.set_epoch(1)
    torch.manual_seed(1)  # another global stream: the augmentation does not draw from it
    resumed = list(islice(resumed_loader, 4))
    assert len(resumed) == 4
    for (x, y), (rx, ry) in zip(uninterrupted[2:], resumed):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_the_augmentation_is_the_samples_own_and_leaves_the_global_stream_alone(tmp_path: Path) -> None:
    dm = _datamodule("digits", tmp_path)
    train = dm.train_set
    torch.manual_seed(0)
    expected_next = torch.rand(3)
    torch.manual_seed(0)
    a = train[(5, 11)][0]
    assert torch.equal(torch.rand(3), expected_next)  # the sample's draws did not move the global stream
    torch.manual_seed(123)
    assert torch.equal(train[(5, 11)][0], a)
    shifted = [not torch.equal(train[(5, seed)][0], a) for seed in range(12, 20)]
    assert any(shifted)  # another seed, another random crop (some of 8 seeds differ from the first)


def test_the_batches_do_not_depend_on_the_worker_count(tmp_path: Path) -> None:
    batches = []
    for workers in (0, 2):
        loader = _datamodule("synthetic", tmp_path, num_workers=workers).train_dataloader()
        loader.sampler.set_epoch(1)
        it = iter(loader)
        batches.append(list(it))
        if workers:
            it._shutdown_workers()  # now, not when collected (a later test would wait for them)
    for (x, y), (wx, wy) in zip(*batches):
        assert torch.equal(x, wx) and torch.equal(y, wy)


def test_step_seed_makes_a_steps_draws_a_function_of_epoch_and_batch() -> None:
    seed = StepSeed()
    seed.seed = 0
    trainer = SimpleNamespace(global_rank=0, current_epoch=2)
    seed.on_train_batch_start(trainer, None, None, 7)  # type: ignore[arg-type]
    first = torch.nn.functional.dropout(torch.ones(64), 0.5)
    torch.rand(100)  # whatever ran in between (validation, a DataLoader started, a resume)
    seed.on_train_batch_start(trainer, None, None, 7)  # type: ignore[arg-type]
    assert torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), first)
    seed.on_train_batch_start(trainer, None, None, 8)  # type: ignore[arg-type]
    assert not torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), first)
    seed.on_train_batch_start(SimpleNamespace(global_rank=1, current_epoch=2), None, None, 7)  # type: ignore[arg-type]
    assert not torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), first)


def test_a_checkpoint_with_the_old_position_restarts_the_epoch_and_says_so() -> None:
    """The position main saved before the StatefulDataLoader ({"epoch", "samples"}) would fail inside torchdata."""
    from recipes.vision.classifier import ImageClassifier

    model = ImageClassifier(arch="timm:test_resnet", num_classes=10)
    old = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [{"epoch": 0, "samples": 24}]}}}}
    with pytest.warns(UserWarning, match="the resumed epoch's order starts anew"):
        model.on_load_checkpoint(old)
    assert "combined_loader" not in old["loops"]["fit_loop"]["state_dict"]
    new = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [{"_num_yielded": 3}]}}}}
    model.on_load_checkpoint(new)  # today's state: kept, silently
    assert new["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"_num_yielded": 3}]
