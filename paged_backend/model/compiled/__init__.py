"""The compiled forward (torch.compile and its cache folder), its regions, decode padding, CUDA graphs,
and the start-up check of the compiled path against the eager one."""
