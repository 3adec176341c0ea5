"""Input adapters: the first child of every built-in model, turning the loader's batch dict into tensors.

An adapter carries ``shardline_input = True``. Pipeline stage cutting (pipeline.parallel.stages) does not
count a parameter-less adapter as a layer and keeps it with stage 0, so ``parallelism.cuts`` mean the same
layers whether or not the model reads a dict. An adapter with parameters (embeddings) is a normal layer.

The batch layout is documented in pipeline.config.feature_spec. A bare tensor is accepted as
``batch['numeric']`` when the features are numeric only, which is what callers that predate the dict
batch pass.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from pipeline.config.feature_spec import LENGTH_SUFFIX, NUMERIC_KEY, FeatureSet, FeatureSpec
from pipeline.errors import ConfigError


def _numeric(batch) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    return batch[NUMERIC_KEY]


def image_floats(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [B, C, H, W] -> float32 in [0, 1]."""
    return pixels.to(torch.float32) / 255.0


class NumericInput(nn.Module):
    """``batch['numeric']`` as it is: the classic models' float [B, num_features] input."""

    shardline_input = True

    def forward(self, batch) -> torch.Tensor:
        return _numeric(batch)


class ImageInput(nn.Module):
    """One image feature as float32 [B, C, H, W] in [0, 1]: the input of the conv tower."""

    shardline_input = True

    def __init__(self, spec: FeatureSpec):
        super().__init__()
        self.name = spec.name
        self.out_shape = (spec.channels, spec.height, spec.width)

    def forward(self, batch) -> torch.Tensor:
        return image_floats(batch[self.name])


class TabularInput(nn.Module):
    """Every feature as one float32 [B, out_features] row: the numeric block, then in spec order an
    embedding per categorical feature, the mean embedding of each text feature's tokens, vector features
    as they are and image features flattened and scaled to [0, 1].

    Embeddings are ``spec.embedding_width`` wide with ``spec.cardinality`` rows. For numeric-only
    features this is ``batch['numeric']`` itself and holds no parameters, so such a model's flat
    parameters are exactly the classic MLP's.
    """

    shardline_input = True

    def __init__(self, features: FeatureSet, sparse: dict | None = None):
        super().__init__()
        sparse = sparse or {}
        if not len(features):
            raise ConfigError("the model has no input features; list at least one in data.features")
        self.numeric_width = features.numeric_width
        # Plain lists of (kind, name) drive forward; the embeddings sit in a ModuleList because feature
        # names are arbitrary strings and ModuleDict keys may not contain '.'. Their order is the spec
        # order, so the flat parameter layout is fixed by the feature set alone.
        self.parts: list[tuple[str, str]] = []
        self.embeddings = nn.ModuleList()
        width = self.numeric_width
        for spec in features:
            if spec.type == "numeric":
                continue
            if spec.type in ("categorical", "text"):
                padding = 0 if spec.type == "text" else None
                if spec.type == "categorical" and sparse.get("min_rows") and spec.cardinality >= sparse["min_rows"]:
                    # ps.sparse: rows on the parameter server, outside the dense parameters
                    from pipeline.models.sparse_embedding import ShardlineEmbedding

                    self.embeddings.append(ShardlineEmbedding(spec.name, spec.cardinality, spec.embedding_width,
                                                              init_std=sparse["init_std"], seed=sparse["seed"]))
                else:
                    self.embeddings.append(nn.Embedding(spec.cardinality, spec.embedding_width, padding_idx=padding))
                width += spec.embedding_width
            elif spec.type == "vector":
                width += spec.length
            elif spec.type == "image":
                width += spec.channels * spec.height * spec.width
            else:
                raise ConfigError(f"feature {spec.name!r} has type {spec.type!r}, which no built-in model reads")
            self.parts.append((spec.type, spec.name))
        self.out_features = width

    def forward(self, batch) -> torch.Tensor:
        if not self.parts:
            return _numeric(batch)
        if isinstance(batch, torch.Tensor):
            raise TypeError(f"this model reads the batch dict ({', '.join(name for _, name in self.parts)} "
                            "besides the numeric block), got a tensor")
        blocks = [batch[NUMERIC_KEY].to(torch.float32)] if self.numeric_width else []
        self._prefetch_sparse(batch)
        embeddings = iter(self.embeddings)
        for kind, name in self.parts:
            value = batch[name]
            if kind == "categorical":
                blocks.append(next(embeddings)(value))
            elif kind == "text":
                blocks.append(_mean_embedding(next(embeddings), value, batch[name + LENGTH_SUFFIX]))
            elif kind == "vector":
                blocks.append(value.to(torch.float32))
            else:
                blocks.append(image_floats(value).flatten(1))
        return torch.cat(blocks, dim=1)


    def _prefetch_sparse(self, batch) -> None:
        """ps.sparse: every sparse table's rows of this batch in one round trip, before the loop reads them."""
        pairs = [(module, batch[name]) for module, (kind, name) in
                 zip(self.embeddings, (p for p in self.parts if p[0] in ("categorical", "text")))
                 if getattr(module, "shardline_sparse", False)]
        if pairs:
            from pipeline.models.sparse_embedding import prefetch

            prefetch(pairs)


def _mean_embedding(embedding: nn.Embedding, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean of the embeddings of each row's first ``lengths`` tokens (zeros for an empty text)."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    mask = (positions.unsqueeze(0) < lengths.unsqueeze(1)).to(embedding.weight.dtype)
    total = (embedding(tokens) * mask.unsqueeze(2)).sum(dim=1)
    # The mask's own count, not `lengths`: a length past max_len (an untruncated count) must not shrink the mean.
    return total / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
