// The int8-activation kernels of Q5_0 and Q8_0: cpu_qdot.h's templates instantiated here, a translation unit
// of their own so the build compiles the families in parallel.
#include "cpu_qdot.h"

namespace swk_qdot {
SWK_QDOT_FAMILY(Q5_0)
SWK_QDOT_FAMILY(Q8_0)
}  // namespace swk_qdot
