"""Tensor parallelism: one worker = a group of ranks, each holding 1/N of the model (Megatron-style).

``sharding`` decides what each rank holds, ``shard_loader`` reads only that from safetensors,
``layers`` holds the row-parallel projections and the vocab-parallel embedding / LM head, ``group``
joins the ranks (gloo on CPU, NCCL on CUDA), ``step_message`` is the one per-step broadcast of a
batch's metadata, ``runner`` the leader's runner and the followers' loop, ``engine`` the rank-0 engine,
``launchers`` starts ranks 1..N-1 (``rank_actor``: Ray actors in the worker's placement group; or, without
Ray, child processes running ``follower``).
"""
