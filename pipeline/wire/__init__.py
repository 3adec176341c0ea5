"""The wire every shardline connection speaks: framing, the mutual HMAC handshake, socket options and
deadlines that name the config key that sets them. Shared by the parameter server and the pipeline
stage links; no Spark, no torch.distributed."""
from pipeline.wire.deadline import Timeout

__all__ = ["Timeout"]
