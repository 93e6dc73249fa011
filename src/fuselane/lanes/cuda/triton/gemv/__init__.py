"""The decode GEMV family: products by checkpoint rows, the weights decoded in the kernel.

Three bodies, one a way of meeting the activations, each shared by its variants (one product, up to four
products of one activation in one launch, the gate/up GLU, an add + norm epilogue):

- `rows`: f32 activations of up to `kernels.GEMV_ROWS` rows, its per-format inner loops in `formats`;
- `fast`: one f32 activation row, a register-prefetched 2-D tile (`fast_norm` adds the add + norm epilogue);
- `q8`: one int8 activation row (`quant.Q8Acts`) multiplied with dp4a (`int8_words`), with `q8_epilogue`
  (add + norm, GLU, each writing int8) and `q8_rope` (the query's and key's rotation after the QKV product);
  `q8_rows` takes a batch's int8 rows through `q8`'s loads and sums, a chunk of weights read once for a tile's
  rows.

`layout` holds the format facts all three read; `parts` the launch in parts (its `Part` descriptor, checks
and the device-side pick and store); `epilogue` the f32 add + norm and the on-device dequantization. See
docs/kernels.md.
"""
