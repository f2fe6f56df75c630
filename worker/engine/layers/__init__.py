"""The model's layers, used at every world size (one rank included): each holds its rank's part of a weight
and loads only that part from a checkpoint.

- linear.py: column / merged-column / QKV / row-parallel linears, each with its method (quant/protocol.py).
- embedding.py: the vocabulary-parallel embedding and LM head.
- experts.py: a rank's slice of every expert of a sparse layer, from each checkpoint layout.
- tensor_parallel.py: `TensorParallel`, the owned decoder's collectives.

The split arithmetic (`shard_for`, `head_shard`, `vocab_shard`) is parallel/memory.py's, shared with the fit check.
"""
