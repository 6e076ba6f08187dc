// The int8-activation kernel of Q4_K: cpu_qdot.h's templates instantiated here, a translation unit of its own (each
// K format takes ~20 s to compile; the build compiles the formats in parallel).
#include "cpu_qdot.h"

namespace swk_qdot {
SWK_QDOT_FAMILY(Q4_K)
}  // namespace swk_qdot
