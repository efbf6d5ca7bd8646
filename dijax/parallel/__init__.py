"""Expert parallelism: the device mesh, logical-axis -> mesh-axis placement, and the ``shard_map`` routed experts
and Engram table lookups.

On one device every helper is a no-op, so the same model code runs on 1 and N devices (docs/scaling.md).
"""
