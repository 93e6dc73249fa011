"""Triton kernels of Qwen3-Next's gated delta-rule layers: the causal convolution with its state, SiLU and the
heads' L2 norm (`conv`), the gates (`gates`), the delta rule over its recurrent state (`delta` a row at a time,
`chunked` a chunk's rows at a time), and the gated RMS norm (`norm`)."""
