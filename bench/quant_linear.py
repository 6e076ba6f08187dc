"""Block-quant matmul (kernels/cpu/cpu_quant.cpp) against the float32 kernel (kernels/cpu/cpu_linear.cpp) on the same
weights dequantized: y = x @ W.T for a few decoder shapes at M = 1 and 8 rows.

    python -m bench.quant_linear --repeats 20

Shapes are K x N (in x out): SmolLM2-135M's MLP up and down, Qwen2.5-0.5B's MLP up. K-quants (256-element
superblocks) need K % 256 == 0, so only 1536 x 576 runs them. Each timing rotates over enough copies of the
weight that the float32 ones fill --pool-mb (more than the last-level cache: a decode step streams its weights from
DRAM). Prints the median time of each and the ratio float32 / quant (above 1: the quant kernel is faster). On a
machine shared with other work, --threads 1 (OpenMP threads that lose their core wait out a scheduler slice).
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

SHAPES = [(576, 1536), (1536, 576), (896, 4864)]
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,)}


def _random_blocks(name: str, N: int, K: int, rng) -> torch.Tensor:
    from swiftk.runtime.ops import cpu_quant

    t = cpu_quant.TYPES[name]
    bs, ts = cpu_quant.block_size(t), cpu_quant.type_size(t)
    raw = rng.integers(0, 256, (N, K // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        v = (rng.uniform(1e-3, 2e-2, raw.shape[:2]) * rng.choice([-1.0, 1.0], raw.shape[:2])).astype(np.float16)
        raw[:, :, off:off + 2] = v.view(np.uint8).reshape(*raw.shape[:2], 2)
    return torch.from_numpy(raw.reshape(N, -1))


def _median_ms(fn, args_list, repeats: int) -> float:
    for a in args_list[:2]:
        fn(*a)
    times = []
    for i in range(repeats):
        a = args_list[i % len(args_list)]
        t = time.perf_counter()
        fn(*a)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quant_linear", description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--pool-mb", type=float, default=96.0)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    from swiftk.runtime.ops import cpu_linear, cpu_quant

    if not (cpu_quant.available() and cpu_linear.available()):
        print(f"# kernels unavailable: quant {cpu_quant.status()}; linear {cpu_linear.status()}")
        return 1
    rng = np.random.default_rng(0)
    Ms = [int(m) for m in a.rows.split(",")]
    types = a.types.split(",")
    print(f"# {cpu_quant.status()}; {torch.get_num_threads()} threads; median of {a.repeats}, "
          f"weights rotated over {a.pool_mb:g} MB of float32 copies; ms and float32/quant ratio")
    print(f"{'type':<5} {'K x N':>10} {'M':>2} {'fp32 ms':>8} {'quant ms':>9} {'ratio':>6}")
    for K, N in SHAPES:
        xs = {M: torch.randn(M, K) for M in Ms}
        for name in types:
            t = cpu_quant.TYPES[name]
            if K % cpu_quant.block_size(t):
                continue
            copies = max(2, math.ceil(a.pool_mb * 2 ** 20 / (N * K * 4)))
            raws = [_random_blocks(name, N, K, rng) for _ in range(copies)]
            dense = [cpu_quant.dequant(t, r, N * K).reshape(N, K) for r in raws]
            for M in Ms:
                x = xs[M]
                f = _median_ms(cpu_linear.linear, [(x, w) for w in dense], a.repeats)
                q = _median_ms(cpu_quant.linear, [(x, r, t, K) for r in raws], a.repeats)
                print(f"{name:<5} {f'{K}x{N}':>10} {M:>2} {f:>8.3f} {q:>9.3f} {f / q:>6.2f}")
            del raws, dense
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
