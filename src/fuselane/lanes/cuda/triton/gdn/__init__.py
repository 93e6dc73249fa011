"""Triton kernels of Qwen3-Next's gated delta-rule layers: the causal convolution with its state, SiLU and the
heads' L2 norm (`conv`), the gates and the delta rule over its recurrent state (`delta`), and the gated RMS norm
(`norm`)."""
