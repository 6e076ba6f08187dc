"""Compile the Triton kernels ahead of time for NVIDIA targets, without a GPU.

The CPU interpreter (TRITON_INTERPRET=1) runs kernels as numpy and misses errors only the real compiler reports
(e.g. a Python global read inside a kernel). This lowers each kernel to a cubin for sm_80 / sm_90 with Triton's own
ptxas, so CI without a GPU still fails on a kernel that would not compile.

    python -m swiftk.kernels.triton.aot_check            # bf16 + fp32, head_dim 128, sm_80 and sm_90 (about a minute)
    python -m swiftk.kernels.triton.aot_check --full     # every dtype, head_dim 64/128/256 (several minutes)
"""
from __future__ import annotations

import argparse
import sys
import time


def _jobs(full: bool):
    from swiftk.runtime.ops.triton_ops import _load

    norm, rope, swiglu, attn, kvc = _load()
    dtypes = ["fp32", "fp16", "bf16"] if full else ["fp32", "bf16"]

    def job(name, fn, ptrs, scalars, consts):
        names = fn.arg_names
        sig = {n: "i32" for n in names}
        sig.update(ptrs)
        sig.update(scalars)
        sig.update({k: "constexpr" for k in consts})
        return name, fn, sig, {(names.index(k),): v for k, v in consts.items()}

    for dt in dtypes:
        p = "*" + dt
        for tree, limit in ((True, False), (False, False), (False, True)):
            for bd in ((64, 128, 256) if full else (128,)):
                consts = dict(TREE=tree, HAS_LIMIT=limit, BLOCK_M=16, BLOCK_N=64 if bd <= 128 else 32, BLOCK_D=bd,
                              DOT_F32=dt == "fp32", PREC="ieee" if dt == "fp32" else "tf32")
                yield job(f"attention {dt} tree={tree} limit={limit} head_dim<={bd}", attn._attn_kernel,
                          {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p, "bits_ptr": "*i32", "mask_ptr": "*u8",
                           "limit_ptr": "*i64"}, {"scale_log2e": "fp32"}, consts)
        yield job(f"add_rmsnorm {dt}", norm._add_rmsnorm_kernel,
                  {k: p for k in ("delta_ptr", "res_ptr", "w_ptr", "normed_ptr", "newres_ptr")} | {"skip_ptr": "*u8"},
                  {"eps": "fp32"}, dict(HAS_DELTA=True, HAS_SKIP=True, BLOCK_R=1, BLOCK_D=1024))
        for inv in ("fp32", "fp64"):
            yield job(f"rope {dt} inv_freq={inv}", rope._rope_kernel,
                      {"x_ptr": p, "out_ptr": p, "pos_ptr": "*i64", "invf_ptr": "*" + inv}, {},
                      dict(BLOCK_H=16, BLOCK_HALF=64, RANGE_REDUCE=inv == "fp64"))
        yield job(f"swiglu {dt}", swiglu._swiglu_kernel, {"gu_ptr": p, "out_ptr": p}, {}, dict(BLOCK_R=1, BLOCK=1024))
        yield job(f"kv_commit {dt}", kvc._kv_commit_kernel, {"cache_ptr": p, "src_ptr": "*i64", "dst_ptr": "*i64"},
                  {}, dict(BLOCK_N=32, BLOCK_D=128))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="all dtypes and head_dim tiers")
    ap.add_argument("--arch", type=int, action="append", help="SM version (repeatable); default 80 and 90")
    args = ap.parse_args(argv)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failed = 0
    start = time.time()
    jobs = list(_jobs(args.full))
    for arch in args.arch or [80, 90]:
        for name, fn, sig, consts in jobs:
            try:
                triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32))
            except Exception as e:  # noqa: BLE001 - report every failing kernel, then fail
                failed += 1
                print(f"FAIL sm_{arch} {name}: {type(e).__name__}: {e}", file=sys.stderr)
    n = len(jobs) * len(args.arch or [80, 90])
    print(f"aot_check: {n - failed}/{n} Triton kernel variants compiled in {time.time() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
