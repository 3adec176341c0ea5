"""How bytes reach a shard and come back (ps-lite's ``van``): the PS message types over ``pipeline.wire``,
a shard's listening socket and handshake, one worker's opening of a shard, the connection roster, and
the shared-memory rings a worker on the shard's own host uses."""
