"""The cuda lane's kernels for DeepSeek's latent attention in its absorbed form: the per-head products
(`heads`), the join of a head's two parts and the rotation of DeepSeek's pairs with YaRN's frequencies
(`parts`), and the attention over the latent cache with the latents as values (`attention`)."""
