"""The attention family: `decode` (flash-decoding over the KV cache, one query row a sequence, split over the
cache's length; `group_decode` its form with a key/value group's heads packed into tensor-core rows; `splits`
what they and the batch's `paged` share) and `prefill` (a chunk's rows against the cache, causal, on the f16
tensor cores)."""
