"""The worker's side of the PS (ps-lite's ``kv_app``): one blocking method per message, over every shard."""
