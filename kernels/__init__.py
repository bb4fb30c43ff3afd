"""CPU expert kernels: the hot path for experts that run on the CPU."""
