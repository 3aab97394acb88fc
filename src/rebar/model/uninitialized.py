"""Layers built without random initialisation: their weights always come from a checkpoint."""

from __future__ import annotations

import torch
from torch import nn


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An nn.Embedding whose weight is left uninitialised (on the current default device).

    Models are built on the meta device and then loaded. nn.Embedding's default init (normal_) on a
    meta tensor runs through torch's Python decompositions, which import torch._dynamo and with it
    Triton: about 1.7 s and 67 MiB of resident memory on every start, for values never used.
    """
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))
