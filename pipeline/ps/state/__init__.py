"""What a shard holds: its slice of the parameters and the condition guarding it (``core``), the
optimizer it steps, and the model's buffers."""
