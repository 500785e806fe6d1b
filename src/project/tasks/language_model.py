"""Causal language modelling: next-token cross-entropy over every scored position, perplexity."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.text import Perplexity

from project.tasks.task import Task

IGNORE = -100  # a target position the loss does not score (cross_entropy's default)


class LanguageModel(Task):
    """`net` maps (batch, time) token ids to (batch, time, vocab) logits; batches are
    (tokens, the same tokens shifted by one)."""

    unit = "tokens"  # throughput: train/tokens_per_s

    def count(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return batch[0].numel()

    def weight(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # The loss is a mean over the scored positions: the epoch's loss weights by them.
        return (batch[1] != IGNORE).sum()

    def metrics(self, stage: str) -> dict[str, Metric]:
        # Training perplexity is exp(train/loss) already: computing it per step costs a softmax.
        return {} if stage == "train" else {"ppl": Perplexity(ignore_index=IGNORE)}

    def step(
        self, batch: tuple[torch.Tensor, torch.Tensor], metrics: Mapping[str, Metric]
    ) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        if "ppl" in metrics:
            metrics["ppl"].update(logits.detach().float(), y)
        return loss
