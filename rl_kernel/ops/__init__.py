"""One module per numeric boundary; each holds the op's contract(s), its strict dispatch and its
native (framework) form. Kernels live in `rl_kernel.backends.<backend>`."""
