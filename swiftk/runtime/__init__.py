"""Runtime: the target model and what runs it -- config, weights and their formats, the KV cache, the attention
masks the kernels read, skip sets, CUDA graphs, sampling primitives and the op backends (ops/). Imports nothing
above it (only swiftk.errors, files, atomic, home)."""
