"""Tensor parallelism: the process group of the ranks that shard one model (``parallel_state``),
its collectives (``communication``) and how full tensors split over the ranks (``sharding``)."""
