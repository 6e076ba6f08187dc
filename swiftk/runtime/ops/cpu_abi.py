"""The C ABI of the CPU kernel library (csrc/include/swiftk_cpu.h) as ctypes signatures, written once: native.py
binds them to the library it loads, and the op modules (cpu_linear, cpu_quant) call the functions as typed here."""
from __future__ import annotations

import ctypes

P, I64, INT, FLT, DBL = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_double
_Q_LINEAR = [P, I64, I64, P, INT, I64, P, I64]   # x, M, K, w, type, N, y, ldy
_LAYERS = [I64, P, P, P, I64, I64, I64, I64, I64, I64, FLT, FLT, I64, P, P, P, P, I64, P, INT]   # + kv_type

# name: (return type, argument types)
SIGNATURES = {
    # cpu_pool.cpp: the threads of the regions that take no count from their caller
    "swk_set_threads": (INT, [INT]),
    "swk_pool_workers": (INT, []),
    # cpu_linear.cpp: y = x @ W^T (float32 / bfloat16 / int8 + scale)
    "swk_linear": (INT, [P, I64, I64, P, INT, P, I64, P, INT]),
    "swk_vector_width": (INT, []),
    # cpu_decode.cpp: the fused layer loop
    "swk_layers": (INT, _LAYERS + [INT]),
    "swk_layers_multi": (INT, _LAYERS + [I64, P, P, INT]),
    "swk_layer_table_width": (INT, []),
    "swk_set_attention_tiles": (None, [INT]),
    # cpu_topk.cpp: top-k rows and acceptance's greedy walk
    "swk_topk_rows": (INT, [P, I64, I64, INT, P]),
    "swk_topk_into": (INT, [P, I64, I64, P, I64, INT, P, I64, P]),
    "swk_greedy_path": (I64, [P, I64, I64, P, P, P, P]),
    # cpu_ngram.cpp: the corpus n-gram chain
    "swk_ngram_propose": (INT, [P, P, INT, INT, P, INT, INT, P, INT, DBL, P, P]),
    # cpu_moa.cpp: one MoA draft step, a round's catch-up
    "swk_moa_step": (INT, [P, P, P, I64, I64, P, P, P, P, P, P]),
    "swk_moa_ingest": (INT, [P, P, P, P, I64, I64, P, P, P, P]),
    # cpu_kv.cpp: the KV cache commit
    "swk_kv_commit": (INT, [P, I64, I64, I64, P, P, I64]),
    # cpu_quant.cpp: GGUF blocks with float32 activations, and the dispatch to cpu_qdot (SWK_Q_INT8_ACT)
    "swk_q_dequant": (INT, [INT, P, I64, P]),
    "swk_q_linear": (INT, [P, I64, I64, P, INT, I64, P]),
    "swk_q_linear_ld": (INT, _Q_LINEAR),
    "swk_q_block_size": (INT, [INT]),
    "swk_q_type_size": (INT, [INT]),
    "swk_q_isa": (INT, []),
    # cpu_qdot.cpp: int8 activations
    "swk_qi_linear_ld": (INT, _Q_LINEAR),
    "swk_qi_linear_ref": (INT, _Q_LINEAR),
    "swk_qi_quantize": (INT, [P, I64, I64, INT, P, P]),
    "swk_qi_isa": (INT, []),
    "swk_qi_repack": (INT, [INT, P, I64, I64, P]),
    "swk_qi_unpack_rows": (INT, [INT, P, I64, I64, P, I64, P]),
}


def bind(lib: ctypes.CDLL) -> list:
    """Types every function of :data:`SIGNATURES` on ``lib``; returns the names it lacks (then nothing is bound)."""
    missing = [name for name in SIGNATURES if not hasattr(lib, name)]
    if missing:
        return missing
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return []
