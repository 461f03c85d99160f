/* What the native kernels that allocate scratch return: 0, or NO_MEMORY when an allocation
 * failed. Their outputs are then undefined and dense/fused.py raises MemoryError. Inside a
 * parallel region, a thread whose scratch failed skips its share of the loop (every thread
 * still meets the loop and its barriers, as OpenMP requires) and flags the call through
 * FLAG_NO_MEMORY into the caller's `int oom`. */
#ifndef GENREC_KERNEL_STATUS_H
#define GENREC_KERNEL_STATUS_H

#define NO_MEMORY 1
#define FLAG_NO_MEMORY(ok)               \
  if (!(ok)) {                           \
    _Pragma("omp atomic write") oom = 1; \
  }

#endif
