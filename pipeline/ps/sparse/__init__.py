"""Sparse embedding tables on the parameter server (issue 18).

A table's rows live on the server, outside the dense flat vector, spread over row shards by id hash
and created on first touch (``table``, ``rows``, ``hashing``), each with row-wise optimizer state
(``rowopt``). A step pulls only the distinct ids of its batch and pushes their summed row gradients
(``frames``: the SPARSE_PULL / SPARSE_ROWS / SPARSE_PUSH frames; ``handlers``: their server side,
registered in ``pipeline.ps.server.dispatch``; ``store``: how pushes become updates in each ``ps.mode``;
``client``: the worker's side over its shard-0 connection). The worker's module is
``pipeline.models.sparse_embedding.ShardlineEmbedding``.

This package imports nothing at import time so that ``pipeline.ps.transport.protocol`` can use ``frames``.
"""
