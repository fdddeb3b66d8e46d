"""ZeRO-R: partitioned activation checkpoints (zerocore.checkpoint), optionally on the host, in fused buffers."""
