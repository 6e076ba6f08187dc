// Q4_K on int8 activations (cpu_qdot.h: the matmul, and KCodec45, the codec Q4_K shares with Q5_K).
#include "cpu_qdot.h"

namespace swk_qdot {
template <>
struct Codec<Q4_K> : KCodec45<Q4_K> { static constexpr Field fields[] = {{0, 2}, {2, 2}, {4, 12}, {16, 128}}; };

SWK_QDOT_FAMILY(Q4_K)
}  // namespace swk_qdot
