"""One-off probes of kernels and library paths."""
