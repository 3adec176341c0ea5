"""ShardlineEmbedding on its own (no PS): distinct-row leaves whose grad is the summed row gradient, local
rows (saved, else the seeded initial row), table files, and the frozen form the served model exports."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from pipeline.config.feature_spec import FeatureSet
from pipeline.models import ModelSpec, build_model, flat_parameters
from pipeline.models.sparse_embedding import (FrozenSparseEmbedding, ShardlineEmbedding, freeze_sparse, load_tables,
                                              save_tables, sparse_modules)


def test_the_leaf_grad_is_the_summed_gradient_of_each_distinct_row():
    sparse = ShardlineEmbedding("t", 10, 3, init_std=1.0)
    dense = nn.Embedding(10, 3)
    with torch.no_grad():
        dense.weight.copy_(torch.from_numpy(sparse.spec.initial_rows(np.arange(10))))
    ids = torch.tensor([[3, 1], [3, 7], [1, 3]])
    weights = torch.randn(3, 2, 3)
    (sparse(ids) * weights).sum().backward()
    (dense(ids) * weights).sum().backward()
    (unique, leaf), = sparse.pulled
    assert unique.tolist() == [1, 3, 7]
    assert torch.allclose(leaf.grad, dense.weight.grad[unique])
    assert list(sparse.parameters()) == []  # nothing of the table is a dense parameter


def test_local_rows_serve_saved_rows_and_the_initial_row_for_unknown_ids(tmp_path):
    model = nn.Sequential(ShardlineEmbedding("a", 0, 2), ShardlineEmbedding("b", 0, 2))
    save_tables({"a": (np.array([5, 2]), np.array([[1, 1], [2, 2]], np.float32))}, str(tmp_path))
    load_tables(model, str(tmp_path))
    a, b = model[0], model[1]
    a.eval()
    out = a(torch.tensor([2, 5, 9]))
    assert out[:2].tolist() == [[2, 2], [1, 1]]
    assert torch.equal(out[2], torch.from_numpy(a.spec.initial_rows(np.array([9]))[0]))
    assert torch.equal(b(torch.tensor([4])), torch.from_numpy(b.spec.initial_rows(np.array([4]))))  # no file: init


def test_a_tables_folder_this_process_cannot_see_is_an_error_not_initial_rows(tmp_path):
    model = nn.Sequential(ShardlineEmbedding("a", 0, 2))
    with pytest.raises(FileNotFoundError, match="workdir_on_every_host=true"):
        load_tables(model, str(tmp_path / "on-another-host"))


def test_frozen_tables_match_local_lookups_and_export(tmp_path):
    module = ShardlineEmbedding("a", 100, 4)
    ids, rows = np.array([3, 10, 42]), np.arange(12, dtype=np.float32).reshape(3, 4)
    module.load_rows(ids, rows)
    model = freeze_sparse(nn.Sequential(module))
    frozen = model[0]
    assert isinstance(frozen, FrozenSparseEmbedding)
    query = torch.tensor([[42, 3], [7, 10]])
    out = frozen(query)
    assert torch.equal(out[0, 0], torch.from_numpy(rows[2])) and torch.equal(out[1, 1], torch.from_numpy(rows[1]))
    assert torch.equal(out[1, 0], torch.zeros(4))  # unknown id: the zero row
    program = torch.export.export(model, (query,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert torch.equal(program.module()(torch.tensor([[10, 99], [3, 3], [42, 0]])),
                       frozen(torch.tensor([[10, 99], [3, 3], [42, 0]])))


def test_tabular_model_keeps_big_categorical_tables_sparse():
    features = FeatureSet.from_list([
        {"name": "n", "type": "numeric"},
        {"name": "small", "type": "categorical", "vocab_size": 10},
        {"name": "big", "type": "categorical", "hash_buckets": 5000},
    ])
    base = dict(kind="tabular", num_features=1, num_outputs=2, task="classification", hidden=(8,),
                features=tuple(features.to_list()))
    dense, sparse = build_model(ModelSpec(**base)), build_model(ModelSpec(
        **base, sparse={"min_rows": 1000, "init_std": 0.1, "seed": 0}))
    (table,) = sparse_modules(sparse)
    assert table.spec.name == "big" and table.spec.num_rows == [s for s in features if s.name == "big"][0].cardinality
    big = [s for s in features if s.name == "big"][0]
    assert flat_parameters(dense).numel() - flat_parameters(sparse).numel() == big.cardinality * big.embedding_width
    batch = {"numeric": torch.randn(4, 1), "small": torch.tensor([1, 2, 3, 4]), "big": torch.tensor([9, 4999, 9, 0])}
    assert sparse(batch).shape == (4, 2)
