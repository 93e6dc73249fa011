"""The cuda lane's Triton kernels, by family: `gemv` (decode products by checkpoint rows, the weights decoded
in the kernel), `attention` (decode, prefill), `gemm` (prefill products), `norm`, `rope`, `quant` (int8
activations), `sample` and `misc` (SwiGLU, arg-max), and `pdl` (dependent launches).

Each module holds kernels and thin launchers for its launches. Shapes the shim must agree with come from
`fuselane.lanes.cuda.plan.kernels`; block layouts from `fuselane.gguf.formats`. See docs/kernels.md.
"""
