"""Triton kernels (swiftk.kernels.triton): one module per op, each tested equal to its torch twin in
swiftk/runtime/ops/reference.py; aot_check.py compiles them for sm_80/sm_90 without a GPU."""
