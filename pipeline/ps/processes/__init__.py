"""Shards in processes of their own (``ps.server_processes``): the driver's proxy, the child's entry
point, the first message and the data-only control pipe between them."""
