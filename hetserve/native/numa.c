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

/* Pins the calling thread and the nthreads of its OpenMP team to cpus[0..ncpus), then reads
 * each thread's mask back from the kernel (sched_getaffinity) into masks[t] (CPUs 0-63, bit c
 * for CPU c; -1 where the team had fewer threads). Returns 0 or the first errno. */
int hetserve_team_pin(int nthreads, const int *cpus, int ncpus, uint64_t *masks) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int i = 0; i < ncpus; i++)
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE) CPU_SET(cpus[i], &set);
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
