"""The device decode of llama.cpp's grid formats (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and its
ternary ones (TQ1_0, TQ2_0): `values.grid_values` gives any value of a 256-value super-block from the file's bytes
and the format's lookup table on the device (`values.device_table`), bit for bit the f32 the cpu lane's
`fuselane.gguf.dequant` gives; `decode.dequantize_grid` decodes a whole matrix with it in one launch.
"""
