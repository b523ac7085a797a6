"""The disk KV tier: prefixes' KV kept in files beyond the pool, across evictions and restarts.

`blocks` names a block of KV (a chained hash under a model fingerprint), `entry` is one block's
file format, `store` the directory (index, capacity, pins, writer). The engine's side (copying
KV between the pool and the tier) is `radixserve.engine.kv_offload`.
"""
