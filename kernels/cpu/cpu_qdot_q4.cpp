// The int8-activation kernels of Q4_0 and Q4_1: cpu_qdot.h's templates instantiated here, a translation unit
// of their own so the build compiles the families in parallel.
#include "cpu_qdot.h"

namespace swk_qdot {
SWK_QDOT_FAMILY(Q4_0)
SWK_QDOT_FAMILY(Q4_1)
}  // namespace swk_qdot
