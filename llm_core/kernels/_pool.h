/*
 * A fork-join pool for the CPU kernels: pool_run(parts, fn, ctx) runs fn(ctx, p, parts) for every
 * part p, part 0 on the calling thread and the others on worker threads, and returns when all are
 * done. Regions are short (a projection, one layer's attention: tens of microseconds to a few
 * milliseconds), so a worker spins on the region counter for a while before it sleeps on a futex,
 * and the caller spins until the parts are done. pool_set_size(n) sets how many threads (caller
 * included) regions use; workers are created on first need and live as long as the process (a
 * forked child starts with none). Linux only (futex); elsewhere every region runs on the caller.
 * Workers never touch Python objects: callers hold no GIL while a region runs.
 */
#ifndef LLM_CORE_POOL_H
#define LLM_CORE_POOL_H

#include <limits.h>
#include <stdint.h>

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_POOL 1
#endif

typedef void (*pool_fn)(void *ctx, int part, int parts);

#define POOL_MAX 64

#ifdef HAVE_POOL
#define POOL_SPINS 2000 /* pause loops (~50 us on Zen 3) before a worker sleeps */

static struct {
    int size, started;     /* threads a region uses (caller included); workers created */
    _Atomic unsigned gen;  /* bumped to start a region */
    _Atomic int pending;   /* workers still in the region */
    _Atomic int sleepers;  /* workers asleep (or about to be) on gen */
    pool_fn fn;
    void *ctx;
    int parts;
} pool = {1, 0, 0, 0, 0, NULL, NULL, 0};

static inline void pool_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* The region counter when each worker was created: its first region is the next one, even when
 * that starts before the thread does. */
static unsigned pool_born[POOL_MAX];

static void *pool_worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    unsigned seen = pool_born[id];
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load(&pool.gen)) == seen) {
            if (++spins < POOL_SPINS) {
                pool_pause();
                continue;
            }
            atomic_fetch_add(&pool.sleepers, 1);
            syscall(SYS_futex, &pool.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0); /* returns at once if gen moved */
            atomic_fetch_sub(&pool.sleepers, 1);
            spins = 0;
        }
        seen = g;
        if (id < pool.parts) pool.fn(pool.ctx, id, pool.parts);
        atomic_fetch_sub(&pool.pending, 1);
    }
    return NULL;
}

static void pool_forget_workers(void) { pool.started = 0, pool.size = 1; } /* in a forked child */

/* Use n threads (caller included) from the next region on; creates missing workers. */
static void pool_set_size(int n) {
    static int atfork_set = 0;
    if (!atfork_set) {
        pthread_atfork(NULL, NULL, pool_forget_workers);
        atfork_set = 1;
    }
    n = n < 1 ? 1 : n > POOL_MAX ? POOL_MAX : n;
    while (pool.started < n - 1) {
        pthread_t t;
        pool_born[pool.started + 1] = atomic_load(&pool.gen);
        if (pthread_create(&t, NULL, pool_worker, (void *)(intptr_t)(pool.started + 1)) != 0) break;
        pthread_detach(t);
        pool.started++;
    }
    pool.size = pool.started + 1 < n ? pool.started + 1 : n;
}

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

static inline int pool_size(void) { return pool.size; }

/* Runs parts 0 .. parts - 1 (at most pool_size() at once are useful: more run in turn on the
 * threads there are). A caller that finds the pool busy (another thread's region) runs them all
 * itself. */
static void pool_run(int parts, pool_fn fn, void *ctx) {
    if (parts <= 1 || pool.size <= 1 || parts > pool.size || pthread_mutex_trylock(&pool_lock) != 0) {
        for (int p = 0; p < parts; p++) fn(ctx, p, parts);
        return;
    }
    pool.fn = fn, pool.ctx = ctx, pool.parts = parts;
    atomic_store(&pool.pending, pool.started);
    atomic_fetch_add(&pool.gen, 1);
    if (atomic_load(&pool.sleepers) > 0) syscall(SYS_futex, &pool.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    fn(ctx, 0, parts);
    while (atomic_load(&pool.pending) > 0) pool_pause();
    pthread_mutex_unlock(&pool_lock);
}
#else
static void pool_set_size(int n) { (void)n; }
static inline int pool_size(void) { return 1; }
static void pool_run(int parts, pool_fn fn, void *ctx) {
    for (int p = 0; p < parts; p++) fn(ctx, p, parts);
}
#endif

/* The part p of [0, n) in `parts` contiguous ranges: [*lo, *hi). */
static inline void pool_split(Py_ssize_t n, int p, int parts, Py_ssize_t *lo, Py_ssize_t *hi) {
    *lo = n * p / parts, *hi = n * (p + 1) / parts;
}

#endif
