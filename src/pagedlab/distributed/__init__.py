"""Tensor parallelism: the process group of the ranks that shard one model (``parallel_state``),
its collectives (``communication``), how a model's sizes split over the ranks (``head_split``) and
how full tensors do (``sharding``)."""
