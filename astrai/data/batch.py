"""`LMBatch`: the one micro-batch layout the causal-LM train step consumes (pretraining windows and packed SFT)."""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from astrai.tree import pytree


@pytree
@attrs.frozen(eq=False)
class LMBatch:
    """Rows of packed documents, right-padded to a common length T.

    A document starts at t == 0 and wherever `positions[b, t] == 0`; attention never crosses documents and
    padding tokens (position 0, loss 0) are one-token documents of their own. `loss_mask` must be 0 where the
    target belongs to another document (the last token of each packed document) and on padding.

    Attributes:
        tokens: [B, T] int64 input ids.
        targets: [B, T] int64 next-token ids (any valid id where `loss_mask` is 0).
        loss_mask: [B, T] float32, 1.0 where `targets[b, t]` is trained.
        positions: [B, T] int64 position of each token inside its document.
    """

    tokens: Tensor
    targets: Tensor
    loss_mask: Tensor
    positions: Tensor

    @property
    def num_loss_tokens(self) -> int:
        """Trained targets in the batch (host sync; the loop sums these to normalise the loss)."""
        return int(self.loss_mask.sum().item())


def document_ids(positions: Tensor) -> Tensor:
    """[B, T] int: index of the document each token belongs to (a new one starts at t == 0 or position 0)."""
    starts = positions == 0
    starts[:, 0] = True
    return torch.cumsum(starts.to(torch.int32), dim=1)
