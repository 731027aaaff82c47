/* NUMA binding for moe/numa_experts.py: a shard's weights moved to and bound on its node
 * (mbind), the node a page is on (get_mempolicy), and a thread team pinned to a node's CPUs
 * (pthread_setaffinity_np on the caller and on each OpenMP thread of its team).
 *
 * The system calls go through syscall(2), not libnuma: nothing to install, and a kernel or
 * container without them answers ENOSYS / EPERM, which Python reports and falls back on (the
 * weights stay where they are). Pinning the calling thread first matters: libgomp keeps one
 * team per thread that opens parallel regions and creates its threads from that thread, so
 * they inherit its mask; each then pins itself too, which covers a team made before. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define HS_MPOL_BIND 2
#define HS_MPOL_MF_STRICT (1 << 0)
#define HS_MPOL_MF_MOVE (1 << 1)
#define HS_MPOL_F_NODE (1 << 0)
#define HS_MPOL_F_ADDR (1 << 1)
#define HS_MAX_NODES 1024

/* Binds the whole pages inside [addr, addr + len) to `node` and moves those already touched
 * there. Returns 0 or an errno (EINVAL: no such node here; ENOSYS/EPERM: no NUMA calls). The
 * partial pages at either end stay as they are: they may hold other allocations. */
int hetserve_mbind(void *addr, long len, int node) {
    if (node < 0 || node >= HS_MAX_NODES) return EINVAL;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t lo = ((uintptr_t)addr + page - 1) & ~(page - 1);
    const uintptr_t hi = ((uintptr_t)addr + (uintptr_t)len) & ~(page - 1);
    if (hi <= lo) return 0;
    unsigned long mask[HS_MAX_NODES / (8 * sizeof(unsigned long))];
    memset(mask, 0, sizeof(mask));
    mask[node / (8 * sizeof(unsigned long))] = 1UL << (node % (8 * sizeof(unsigned long)));
    long rc = syscall(SYS_mbind, (void *)lo, (unsigned long)(hi - lo), HS_MPOL_BIND, mask,
                      (unsigned long)HS_MAX_NODES + 1, HS_MPOL_MF_MOVE | HS_MPOL_MF_STRICT);
    return rc == 0 ? 0 : errno;
}

/* The node holding the page at addr (touched first where it is not), or -errno. */
int hetserve_page_node(void *addr) {
    volatile char *p = (volatile char *)addr;
    (void)*p;
    int node = -1;
    long rc = syscall(SYS_get_mempolicy, &node, NULL, 0UL, addr, HS_MPOL_F_NODE | HS_MPOL_F_ADDR);
    return rc == 0 ? node : -errno;
}

static int pin_self(const cpu_set_t *set) {
    return pthread_setaffinity_np(pthread_self(), sizeof(*set), set);
}

static int pin_team(int nthreads, const cpu_set_t *set, uint64_t *masks);

/* Pins the calling thread and the nthreads of its OpenMP team to cpus[0..ncpus), then reads
 * each thread's mask back from the kernel (sched_getaffinity) into masks[t] (CPUs 0-63, bit c
 * for CPU c; -1 where the team had fewer threads). Returns 0 or the first errno. */
int hetserve_team_pin(int nthreads, const int *cpus, int ncpus, uint64_t *masks) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int i = 0; i < ncpus; i++)
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE) CPU_SET(cpus[i], &set);
    return pin_team(nthreads, &set, masks);
}

static int pin_team(int nthreads, const cpu_set_t *cpuset, uint64_t *masks) {
    const cpu_set_t set = *cpuset;
    int err = pin_self(&set);
    if (err != 0) return err;
    for (int t = 0; t < nthreads; t++) masks[t] = (uint64_t)-1;
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        int e = pin_self(&set);
        cpu_set_t got;
        CPU_ZERO(&got);
        if (e == 0 && sched_getaffinity(0, sizeof(got), &got) != 0) e = errno;
        uint64_t m = 0;
        for (int c = 0; c < 64; c++)
            if (CPU_ISSET(c, &got)) m |= 1ULL << c;
        if (t < nthreads) masks[t] = m;
        if (e != 0) __atomic_store_n(&err, e, __ATOMIC_RELAXED);
    }
    return err;
}

/* A node's team (moe/numa_experts.py): one pthread, pinned with its OpenMP team, that runs the
 * shard calls posted to it. Python posts a layer's shards with one call
 * (hetserve_moe_run_teams) and no GIL hand-offs: through a Python thread pool a layer paid
 * ~85 us of wake-ups on 2 cores, twice the one-token int8 layer itself. */
int hetserve_moe_run_shard(void *h, int nthreads, int T, int k, const int64_t *ids,
                           const float *tw, const float *x, float *out, int *turn, int my);

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int left, rc;
} hs_call_t;

typedef struct {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    cpu_set_t set;
    int nthreads, err, ready, stop, tid;
    uint64_t masks[64];
    long posted, taken;
    void *h; /* the posted shard call */
    int T, k, my;
    const int64_t *ids;
    const float *tw, *x;
    float *out;
    int *turn;
    hs_call_t *call;
} hs_team_t;

static void call_done(hs_call_t *c, int rc) {
    pthread_mutex_lock(&c->mu);
    if (rc != 0 && (c->rc == 0 || rc == -2)) c->rc = rc; /* a bad id wins: all shards see it */
    if (--c->left == 0) pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static void *team_main(void *arg) {
    hs_team_t *t = (hs_team_t *)arg;
    const int err = pin_team(t->nthreads, &t->set, t->masks);
    pthread_mutex_lock(&t->mu);
    t->err = err, t->tid = (int)syscall(SYS_gettid), t->ready = 1;
    pthread_cond_broadcast(&t->cv);
    for (;;) {
        while (t->posted == t->taken && !t->stop) pthread_cond_wait(&t->cv, &t->mu);
        if (t->stop) break;
        t->taken = t->posted;
        pthread_mutex_unlock(&t->mu);
        const int rc = hetserve_moe_run_shard(t->h, t->nthreads, t->T, t->k, t->ids, t->tw, t->x,
                                              t->out, t->turn, t->my);
        call_done(t->call, rc);
        pthread_mutex_lock(&t->mu);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* Starts a team of nthreads on cpus; NULL when out of memory or threads. *err: the pinning's
 * errno (0 when it took), masks[0..nthreads) each thread's mask read back (as team_pin),
 * *tid the team thread's kernel id. */
void *hetserve_team_new(const int *cpus, int ncpus, int nthreads, int *err, uint64_t *masks,
                        int *tid) {
    hs_team_t *t = calloc(1, sizeof(*t));
    if (t == NULL || nthreads < 1 || nthreads > 64) return free(t), NULL;
    CPU_ZERO(&t->set);
    for (int i = 0; i < ncpus; i++)
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE) CPU_SET(cpus[i], &t->set);
    t->nthreads = nthreads;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    if (pthread_create(&t->th, NULL, team_main, t) != 0) return free(t), NULL;
    pthread_mutex_lock(&t->mu);
    while (!t->ready) pthread_cond_wait(&t->cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
    *err = t->err, *tid = t->tid;
    memcpy(masks, t->masks, sizeof(uint64_t) * (size_t)nthreads);
    return t;
}

void hetserve_team_free(void *p) {
    hs_team_t *t = (hs_team_t *)p;
    pthread_mutex_lock(&t->mu);
    t->stop = 1;
    pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->th, NULL);
    free(t);
}

/* One layer's shards, handles[i] on teams[i], at once; returns when all are done: 0, or the
 * first error of hetserve_moe_run_shard (-2, a bad expert id, before any other). */
int hetserve_moe_run_teams(void **teams, void **handles, int n, int T, int k,
                           const int64_t *ids, const float *tw, const float *x, float *out) {
    /* one call at a time: a team holds one posted job (callers on two threads take turns) */
    static pthread_mutex_t one = PTHREAD_MUTEX_INITIALIZER;
    hs_call_t call = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, n, 0};
    int turn = 0;
    pthread_mutex_lock(&one);
    for (int i = 0; i < n; i++) {
        hs_team_t *t = (hs_team_t *)teams[i];
        pthread_mutex_lock(&t->mu);
        t->h = handles[i], t->T = T, t->k = k, t->my = i, t->ids = ids, t->tw = tw, t->x = x;
        t->out = out, t->turn = &turn, t->call = &call;
        t->posted++;
        pthread_cond_signal(&t->cv);
        pthread_mutex_unlock(&t->mu);
    }
    pthread_mutex_lock(&call.mu);
    while (call.left > 0) pthread_cond_wait(&call.cv, &call.mu);
    pthread_mutex_unlock(&call.mu);
    pthread_mutex_unlock(&one);
    return call.rc;
}
