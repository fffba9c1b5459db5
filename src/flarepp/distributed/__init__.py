"""Exact token-sharded context parallelism and block-wise streaming (paper Appendix B).

Applied from outside a single-device model, through the mixers' attention backend:

* :func:`context_parallel` -- split a mesh's tokens over a process group; every encode is
  merged exactly across ranks (:func:`distributed_encode_with_lse`), decodes stay local,
  :func:`all_reduce_gradients` gives every rank the unsharded gradient.
* :func:`stream_forward` -- run a mesh of any size through one device in chunks, merging
  the chunks' encoder partials by the same log-sum-exp rule.
* :func:`run_on_ranks` -- R local processes in a gloo group (tests, CPU benchmarks).
"""

from flarepp.distributed.encoder import (distributed_encode_with_lse, global_sum,
                                         merge_across_ranks)
from flarepp.distributed.launch import RankFailure, run_on_ranks
from flarepp.distributed.parallel import (ContextParallel, ContextParallelBackend,
                                          all_reduce_gradients, broadcast_parameters,
                                          check_replicas, context_parallel, gather_tokens,
                                          shard_sizes, shard_slice)
from flarepp.distributed.shardable import (SHARDABLE_MIXERS, SHARDABLE_MODELS,
                                           check_token_shardable)
from flarepp.distributed.streaming import StreamingBackend, stream_forward, streaming_refusal

__all__ = [
    "ContextParallel", "ContextParallelBackend", "RankFailure", "SHARDABLE_MIXERS",
    "SHARDABLE_MODELS", "StreamingBackend", "all_reduce_gradients", "broadcast_parameters",
    "check_replicas", "check_token_shardable", "context_parallel",
    "distributed_encode_with_lse", "gather_tokens", "global_sum",
    "merge_across_ranks", "run_on_ranks", "shard_sizes", "shard_slice",
    "stream_forward", "streaming_refusal",
]
