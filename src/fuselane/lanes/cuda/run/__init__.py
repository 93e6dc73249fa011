"""The cuda lane's run side: the lane (buffers, steps, CUDA graphs), the table that binds each op of a plan to
its one launch, and the decode loop with its device sampler. Loads torch, and Triton's kernels on first bind."""
