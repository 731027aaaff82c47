/* The parallel loop shared by hetserve's native kernels (see pool.c). */
#ifndef HETSERVE_POOL_H
#define HETSERVE_POOL_H

/* Runs fn(ctx, i) for every i in [0, total) on up to nthreads threads (the caller included),
 * items handed out one at a time; returns when every item is done. */
typedef void (*hs_task_fn)(void *ctx, int item);
void hs_parallel_for(int nthreads, int total, hs_task_fn fn, void *ctx);

#endif
