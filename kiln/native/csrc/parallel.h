/* When kiln's kernels wake torch's OpenMP threads. Entering an OpenMP region costs 1-2 us a call even with one
   thread (libgomp sets up a team and a barrier; with two it also wakes the other through a futex), more than a
   small layer's whole work, so such layers run on the calling thread without entering one. */
#ifndef KILN_PARALLEL_H
#define KILN_PARALLEL_H

#include <omp.h>
#include <stdint.h>

/* Below this many multiply-adds (~2 us of one core's work) a layer runs on the calling thread. */
#define PARALLEL_MACS 65536

/* Whether `units` of work totalling `macs` multiply-adds are worth sharing among the threads. */
static inline int threads_pay(int64_t units, int64_t macs) {
  return units > 1 && macs >= PARALLEL_MACS && omp_get_max_threads() > 1;
}

/* Runs the block, which shares its loop out with `_Pragma("omp for ...")`, in a parallel region where `parallel`,
   else on the calling thread alone: an `omp for` outside any region runs as a team of one, its schedule worked out
   inline and its barrier a no-op. (Variadic so that the block's commas pass through the preprocessor.) */
#define MAYBE_PARALLEL(parallel, ...)                                                                              \
  do {                                                                                                             \
    if (parallel) {                                                                                                \
      _Pragma("omp parallel") __VA_ARGS__                                                                          \
    } else {                                                                                                       \
      __VA_ARGS__                                                                                                  \
    }                                                                                                              \
  } while (0)

#endif /* KILN_PARALLEL_H */
