"""Tensor and expert parallel: each of `tp` ranks holds a slice of every layer, cut from the checkpoint's
quantized blocks, and runs a graph of its slice's widths with all-reduces where the slices' partial sums meet.

`shard` says which part of every axis a rank owns, `slicing` cuts quantized tensors without decoding them,
`ranks` gives a rank its config and tensors, `ops` the collective primitives, `executor` runs a rank's graph
in NumPy over a `torch.distributed` group (gloo) to check the rank logic on CPU processes.
"""
