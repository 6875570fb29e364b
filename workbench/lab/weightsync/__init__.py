"""The RL weight sync inside a rank: trainer shards out, packed buffers across, named tensors in.

Small pieces a user can step their own sync through, one concern each:

- ``model``: a tiny real ``DeepseekV3ForCausalLM`` (one MoE layer, fp32 router bias), the
  expert-parallel shard view a trainer rank exports, loading by name, routing and log-probs;
- ``pack``: buckets by byte threshold, one contiguous buffer per (bucket, dtype) with its
  metadata (names, dtype names, shapes, sizes);
- ``ipc``: handles to packed buffers (CUDA IPC on GPU, shared memory on CPU), their
  all-gather, and rank 0's update request;
- ``receive``: rebuild a handle, slice it by metadata, load into a model;
- ``broadcast`` and ``conversion``: the non-colocated packed broadcast and the exporting
  extractor (part 2).

Imports only ``rank/``, ``lab/``, ``workbench.errors`` and ``workbench.scenario``.
"""
