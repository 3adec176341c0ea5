"""The serving side (ps-lite's ``customer``): one shard's request loop and dispatch table, the shards of a
server driven as one (``parameter_server``, ``staged``, ``fanout``), failures, counters and timing."""
