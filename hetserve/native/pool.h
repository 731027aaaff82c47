/* The parallel loop shared by hetserve's native kernels (see pool.c). */
#ifndef HETSERVE_POOL_H
#define HETSERVE_POOL_H

/* Runs fn(ctx, i) for every i in [0, total) on up to nthreads threads (the caller included):
 * each thread takes the items of its own contiguous range in order, then steals from the back
 * of the others' (pool.c); returns when every item is done. */
typedef void (*hs_task_fn)(void *ctx, int item);
void hs_parallel_for(int nthreads, int total, hs_task_fn fn, void *ctx);

/* Runs fn(ctx, r0, r1) over rows [0, rows): in blocks of `block` rows on up to nthreads threads
 * where there are many (4 blocks or more: prefill's thousands of rows), else once on the
 * caller's thread (decode's few: waking the team costs more than the work). For work whose rows
 * are independent, so any split gives the same result. */
typedef void (*hs_rows_fn)(void *ctx, int r0, int r1);
void hs_parallel_rows(int nthreads, int rows, int block, hs_rows_fn fn, void *ctx);

/* Units (row quads, ...) per work item when streaming weights: enough for item_bytes of them (a
 * thread's stream then runs long enough for the prefetchers before it jumps), but no more than
 * leaves every thread 4 items of the `total` (a descheduled thread then holds back a quarter of
 * its share), and never fewer than min_units. */
static inline int hs_item_units(long unit_bytes, long item_bytes, int total, int nthreads,
                                int min_units) {
    long n = item_bytes / (unit_bytes > 0 ? unit_bytes : 1);
    const long balance = total / (4L * (nthreads > 0 ? nthreads : 1));
    n = n < balance ? n : balance;
    return n < min_units ? min_units : (int)n;
}

#endif
