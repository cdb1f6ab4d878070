"""A count function and a module that LightningCLI imports by dotted path from its arguments
(``test_trainer_setups.py::test_count_fn_by_import_path_in_lightning_cli``)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch


def count_tokens(batch):  # type: ignore[no-untyped-def]  # no annotations on purpose: what users write in a script
    return (batch["labels"] != -100).sum()


class CLIModule(pl.LightningModule):
    """The smallest module LightningCLI can build from arguments alone."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)
