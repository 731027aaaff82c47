/* hs_parallel_for (pool.h) on OpenMP.
 *
 * Built with -fopenmp, this library links libgomp.so.1 by its soname, and in a process where
 * torch has already loaded its own libgomp.so.1 the dynamic loader hands back that copy: the
 * kernels then share torch's thread team instead of fighting it for the cores (a private pthread
 * pool lost ~4x at decode on 2 cores, its helpers descheduled by torch's spinning workers).
 * Without OpenMP the loop simply runs on the caller.
 *
 * Each thread owns a contiguous range of the items and takes them in order, one at a time;
 * a thread whose range is done steals the last item of the range with the most left. Callers
 * number items along their data (the expert kernels: along each expert's weights), so a thread
 * streams one run of memory from item to item and its prefetches past an item's end fetch what
 * it reads next. Items handed out in turn (schedule(dynamic)) would each begin a new stream,
 * with their prefetches read by the other core: a one-token layer ran up to ~1.08x slower so.
 * A descheduled thread still holds back at most the item it is on: the others steal the rest
 * of its range. Items write disjoint outputs, so the order does not change the results. */
#include "pool.h"

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* One thread's range: next item in the low 32 bits, end in the high 32 (one atomic word). */
typedef struct {
    _Alignas(64) uint64_t r;
} range_t;

/* An item from the front (the owner) or the back (a thief) of g, or -1 when it is empty. */
static int take(range_t *g, int back) {
    uint64_t v = __atomic_load_n(&g->r, __ATOMIC_RELAXED);
    for (;;) {
        const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
        if (lo >= hi) return -1;
        const uint64_t nv = back ? (uint64_t)lo | (uint64_t)(hi - 1) << 32
                                 : (uint64_t)(lo + 1) | (uint64_t)hi << 32;
        if (__atomic_compare_exchange_n(&g->r, &v, nv, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return back ? (int)hi - 1 : (int)lo;
    }
}

/* The item to steal: the last of the range with the most left, or -1 when all are empty. */
static int steal(range_t *g, int n) {
    for (;;) {
        int best = -1;
        uint32_t most = 0;
        for (int v = 0; v < n; v++) {
            const uint64_t r = __atomic_load_n(&g[v].r, __ATOMIC_RELAXED);
            const uint32_t lo = (uint32_t)r, hi = (uint32_t)(r >> 32);
            if (hi > lo && hi - lo > most) most = hi - lo, best = v;
        }
        if (best < 0) return -1;
        const int i = take(&g[best], 1);
        if (i >= 0) return i;
    }
}

typedef struct {
    hs_rows_fn fn;
    void *ctx;
    int rows, block;
} rows_arg_t;

static void rows_item(void *ctx, int c) {
    const rows_arg_t *a = (const rows_arg_t *)ctx;
    const int r0 = c * a->block, r1 = r0 + a->block < a->rows ? r0 + a->block : a->rows;
    a->fn(a->ctx, r0, r1);
}

void hs_parallel_rows(int nthreads, int rows, int block, hs_rows_fn fn, void *ctx) {
    if (rows < 4 * block || nthreads < 2) {
        if (rows > 0) fn(ctx, 0, rows);
        return;
    }
    rows_arg_t a = {fn, ctx, rows, block};
    hs_parallel_for(nthreads, (rows + block - 1) / block, rows_item, &a);
}

void hs_parallel_for(int nthreads, int total, hs_task_fn fn, void *ctx) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > total) nthreads = total > 0 ? total : 1;
    if (nthreads == 1) {
        for (int i = 0; i < total; i++) fn(ctx, i);
        return;
    }
    range_t g[nthreads];
    for (int t = 0; t < nthreads; t++) {
        const uint64_t lo = (uint64_t)total * t / nthreads;
        g[t].r = lo | (uint64_t)total * (t + 1) / nthreads << 32;
    }
    /* a team smaller than asked for (nested regions) leaves ranges to steal, not items lost */
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        for (;;) {
            int i = take(&g[t], 0);
            if (i < 0 && (i = steal(g, nthreads)) < 0) break;
            fn(ctx, i);
        }
    }
}
