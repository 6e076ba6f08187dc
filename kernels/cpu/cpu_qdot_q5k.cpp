// Q5_K on int8 activations (cpu_qdot.h: the matmul, and KCodec45, the codec Q5_K shares with Q4_K).
#include "cpu_qdot.h"

namespace swk_qdot {
template <>
struct Codec<Q5_K> : KCodec45<Q5_K> {
  static constexpr Field fields[] = {{0, 2}, {2, 2}, {4, 12}, {16, 32}, {48, 128}};
};

SWK_QDOT_FAMILY(Q5_K)
}  // namespace swk_qdot
