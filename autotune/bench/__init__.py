"""Every benchmark, one module each, behind `tandem bench ...` and `tandem make-bench-model`: decode, offload,
quant, numerics, e2e, kernels, plan (the planner against real runs) and models (random-weight checkpoints of real
models' shapes, from the one table in `shapes`). They measure; the tuner's own measurements are `autotune.microbench`.
"""
