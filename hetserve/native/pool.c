/* hs_parallel_for (pool.h) on OpenMP.
 *
 * Built with -fopenmp, this library links libgomp.so.1 by its soname, and in a process where
 * torch has already loaded its own libgomp.so.1 the dynamic loader hands back that copy: the
 * kernels then share torch's thread team instead of fighting it for the cores (a private pthread
 * pool lost ~4x at decode on 2 cores, its helpers descheduled by torch's spinning workers).
 * Items go out one at a time (schedule(dynamic)), so a descheduled thread holds back at most
 * one item. Without OpenMP the loop simply runs on the caller. */
#include "pool.h"

void hs_parallel_for(int nthreads, int total, hs_task_fn fn, void *ctx) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > total) nthreads = total > 0 ? total : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int i = 0; i < total; i++) fn(ctx, i);
}
