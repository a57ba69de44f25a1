"""The one tiny LightningModule, data and ``fit`` helper that every callback test uses.

Imported by the test modules (a DDP script or spawned worker needs them at import level
too). Also the checks of a
NormSwap checkpoint: its record (:func:`normswap_record`) and a model restored from it
(:func:`assert_same_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

__all__ = ["ManualModule", "TinyModule", "assert_same_model", "conv_net", "fit", "image_data", "normswap_record",
           "per_sample_net"]

NetFactory = Callable[[], nn.Module]


def conv_net() -> nn.Sequential:
    """BatchNorm2d (an in-place ReLU after it, as in a ResNet) and a LayerNorm head: the norms
    a swap converts and a monitor watches, with 8-channel layers (4 phasors)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(8), nn.Linear(8, 5),
    )


def per_sample_net() -> nn.Sequential:
    """Only per-sample norms (MRSNorm2d over each sample, GroupNorm, MRSNorm, LayerNorm; no
    BatchNorm): a batch split into parts (accumulation, DDP) gives the same input gradients."""
    from lightning_mrs import MRSNorm, MRSNorm2d

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), MRSNorm2d(8, spatial=True), nn.GELU(),
        nn.Conv2d(8, 6, 3, padding=1), nn.GroupNorm(2, 6), nn.GELU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 10), MRSNorm(10), nn.LayerNorm(10), nn.Linear(10, 5),
    )


def image_data(n: int = 32, size: tuple[int, int] = (7, 5), classes: int = 5, seed: int = 1) -> TensorDataset:
    """``n`` random ``(3, *size)`` images with labels in ``[0, classes)``, the same for a seed."""
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, *size, generator=gen), torch.randint(0, classes, (n,), generator=gen))


class TinyModule(pl.LightningModule):
    """Cross-entropy on ``net`` with SGD, logged as ``train/loss`` (``self.log``); ``net`` is built
    in ``__init__`` (``build="init"``), in ``configure_model`` (``"configure_model"``) or in
    ``setup`` (``"setup"``).

    Args:
        net_fn: the backbone's factory (called once, under ``torch.manual_seed(seed)``).
        lr: the SGD learning rate.
        build: where the backbone is built.
        seed: seed of the backbone's initialisation.
    """

    def __init__(self, net_fn: NetFactory = conv_net, lr: float = 0.05, build: str = "init", seed: int = 0) -> None:
        super().__init__()
        if build not in ("init", "configure_model", "setup"):
            raise ValueError(f"build={build!r}")
        self.net_fn, self.lr, self.build, self.seed = net_fn, lr, build, seed
        self.net: Optional[nn.Module] = self._make() if build == "init" else None

    def _make(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return self.net_fn()

    def configure_model(self) -> None:
        if self.build == "configure_model" and self.net is None:  # idempotent, as Lightning asks
            self.net = self._make()

    def setup(self, stage: str) -> None:
        if self.build == "setup" and self.net is None:
            self.net = self._make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # (N, 3, H, W) -> (N, classes)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class ManualModule(TinyModule):
    """:class:`TinyModule` under manual optimization with two SGD optimizers (the first half of
    the parameters, the rest), each stepping once per batch: ``trainer.global_step`` advances
    by 2 per batch. Pass ``steps=2 * batches`` to :func:`fit`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizers = self.optimizers()
        for opt in optimizers:
            opt.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        for opt in optimizers:
            opt.step()
        return loss.detach()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        params = list(self.parameters())
        half = len(params) // 2
        return [torch.optim.SGD(params[:half], lr=self.lr), torch.optim.SGD(params[half:], lr=self.lr)]


def fit(
    module: Union[pl.LightningModule, NetFactory, None] = None,
    *,
    steps: int = 2,
    callbacks: Iterable[pl.Callback] = (),
    logger: Any = False,
    data: Optional[TensorDataset] = None,
    batch_size: int = 8,
    sampler: Optional[Sampler] = None,
    ckpt_path: Optional[str] = None,
    **trainer_kw: Any,
) -> tuple[pl.Trainer, pl.LightningModule]:
    """Fit ``module`` (a LightningModule, or a backbone factory wrapped in :class:`TinyModule`)
    for ``steps`` optimizer steps on the CPU, quietly; returns ``(trainer, module)``.

    The loader takes ``data`` (default :func:`image_data`) in order, or as ``sampler`` says."""
    if module is None or not isinstance(module, pl.LightningModule):
        module = TinyModule(module or conv_net)
    trainer_kw.setdefault("accelerator", "cpu")
    trainer_kw.setdefault("devices", 1)
    trainer_kw.setdefault("log_every_n_steps", 1)
    trainer = pl.Trainer(
        max_steps=steps, logger=logger, callbacks=list(callbacks), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **trainer_kw,
    )
    loader = DataLoader(data if data is not None else image_data(), batch_size=batch_size, sampler=sampler)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module


def normswap_record(path: Path) -> dict[str, Any]:
    """The NormSwap callback's state in the checkpoint at ``path``."""
    # weights_only=True: the record must be plain data (what NormSwap.restore reads safely)
    (state,) = [v for k, v in torch.load(path, weights_only=True)["callbacks"].items() if k.startswith("NormSwap")]
    return state


def assert_same_model(restored: nn.Module, path: Path, trained: nn.Module, x: torch.Tensor) -> None:
    """``restored`` holds exactly the weights of the checkpoint at ``path`` (same keys, same
    order, equal tensors) and computes on ``x`` what ``trained`` does, to the bit."""
    saved = torch.load(path, weights_only=True)["state_dict"]
    got = restored.state_dict()
    assert list(got) == list(saved)
    for key, value in saved.items():
        assert torch.equal(got[key], value), key
    torch.testing.assert_close(restored.eval()(x), trained.eval()(x), atol=0, rtol=0)
