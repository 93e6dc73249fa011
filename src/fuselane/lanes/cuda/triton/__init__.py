"""The cuda lane's Triton kernels.

Each module holds kernels and thin launchers for one family of launches (`gemv`: decode products by
checkpoint rows, dequantized in the kernel). Shapes the shim must agree with come from
`fuselane.lanes.cuda.kernels`; block layouts from `fuselane.gguf.formats`.
"""
