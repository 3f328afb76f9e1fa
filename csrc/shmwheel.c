/*
 * shmwheel.c - the operations on a shmwheel segment.  See docs/design.md for
 * the design and the byte layout, shmwheel.h for the structs and the API.
 *
 * Conventions: public functions are shmw_*, file-local helpers have no
 * prefix.  Every public function checks its arguments and reads the clock
 * before it takes the lock; under the lock there is only arithmetic and
 * loads and stores to the segment.
 */
#define _GNU_SOURCE
#include "shmwheel.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/random.h>
#include <sys/syscall.h>

#define ALIGN_UP(x, a) (((x) + (uint64_t)(a) - 1) & ~((uint64_t)(a) - 1))

struct shmw {
    /* Private copies of the parameters: bounds are checked against these,
     * never against the segment, which any process can scribble on. */
    char                *base;
    struct shmw_header  *hdr;
    struct shmw_bucket  *buckets;
    uint32_t            *heap;
    struct shmw_list    *lists;
    char                *slab;
    uint64_t             size;
    int64_t              tick_ns;
    uint32_t             capacity;
    uint32_t             payload_size;
    uint32_t             wheel_bits;
    uint32_t             wheel_mask;
    uint32_t             levels;
    uint32_t             nbuckets;
    uint32_t             slot_bits;
    uint32_t             stride;
    uint64_t             max_generation;
    uint64_t             handle_key;    /* the header's, masked to the generation bits */
    int64_t              lock_timeout_ns;
    uint32_t             producer;      /* this process's producer slot, or SHMW_NO_PRODUCER */
    pid_t                producer_pid;  /* the pid that slot was taken for (fork changes it) */
};

/* ---- crash points (tests only) --------------------------------------------
 * Every store to the segment goes through STORE, or COMMIT for the store
 * that commits an entry or a slot (its state, a producer's pid).
 * shmw_test_crash_after(n) makes this process _exit(SHMW_CRASH_EXIT) just
 * before its n-th store from then on, so that a test can stop an operation
 * at every step and check what the next locker makes of it; off (0) by
 * default, it costs one predictable branch a store.  COMMIT is a release
 * store: everything written before it - the entry's own fields - reaches
 * memory first, which is what makes a half-made change repairable after a
 * real SIGKILL.  The other stores are links and counters that the repair
 * rebuilds, so their order does not matter and the compiler may keep them
 * in registers. */

static long crash_countdown;
static int crash_stops;         /* SIGSTOP instead of _exit: a holder frozen mid-operation */

static void crash_now(void)
{
    if (crash_stops)
        raise(SIGSTOP);         /* and carries on when continued */
    else
        _exit(SHMW_CRASH_EXIT);
}

static inline void crash_point(void)
{
    if (__builtin_expect(crash_countdown > 0, 0) && --crash_countdown == 0)
        crash_now();
}

#define STORE(lhs, rhs) do {                    \
        crash_point();                          \
        (lhs) = (rhs);                          \
    } while (0)

#define COMMIT(lhs, rhs) do {                                   \
        crash_point();                                          \
        __atomic_store_n(&(lhs), (rhs), __ATOMIC_RELEASE);      \
    } while (0)

void shmw_test_crash_after(long n)
{
    crash_countdown = n > 0 ? n : 0;
    crash_stops = 0;
}

void shmw_test_stop_after(long n)
{
    crash_countdown = n > 0 ? n : 0;
    crash_stops = 1;
}

/* ---- process identity ---------------------------------------------------
 * getpid() is a system call on current glibc; the pid is cached and
 * refreshed in the child after fork so the add path never makes one. */

static pid_t cached_pid;
static pthread_once_t pid_once = PTHREAD_ONCE_INIT;

static void refresh_pid(void) { cached_pid = getpid(); }

static void pid_init(void)
{
    refresh_pid();
    pthread_atfork(NULL, NULL, refresh_pid);
}

/* ---- pure arithmetic ---------------------------------------------------- */

uint64_t shmw_ticks_ceil(int64_t ns, int64_t tick_ns)
{
    if (ns <= 0 || tick_ns <= 0)
        return 0;
    return (uint64_t)ns / (uint64_t)tick_ns + ((uint64_t)ns % (uint64_t)tick_ns != 0);
}

uint32_t shmw_level_for(uint64_t elapsed, uint64_t t, uint32_t wheel_bits)
{
    /* The lowest level whose window of W buckets past its own clock holds t.
     * A t at or before the clock belongs in level 0 (it is due). */
    uint64_t w = 1ULL << wheel_bits;
    uint32_t level = 0;
    uint32_t shift = 0;

    if (t <= elapsed || wheel_bits == 0 || wheel_bits >= 32)
        return 0;
    for (; shift < 64; level++, shift += wheel_bits)
        if ((t >> shift) - (elapsed >> shift) < w)
            return level;
    return level;               /* both shifted to 0 */
}

uint32_t shmw_slot_for(uint64_t t, uint32_t level, uint32_t wheel_bits)
{
    uint32_t shift = level * wheel_bits;

    if (shift >= 64 || wheel_bits >= 32)
        return 0;
    return (uint32_t)((t >> shift) & ((1ULL << wheel_bits) - 1));
}

uint64_t shmw_bucket_expiry(uint64_t t, uint32_t level, uint32_t wheel_bits)
{
    uint32_t shift = level * wheel_bits;

    if (shift >= 64)
        return 0;
    return t & ~((1ULL << shift) - 1);
}

uint32_t shmw_levels_for(int64_t tick_ns, uint32_t wheel_bits)
{
    /* Smallest L whose top window, (W - 1) * W^(L-1) ticks, exceeds twice
     * the longest delay: the delay itself plus as much again of driver lag
     * (elapsed behind the real clock), so that every accepted timer has a
     * level even if nobody polls for a century. */
    uint64_t need = 2 * shmw_ticks_ceil(SHMW_MAX_DELAY_NS, tick_ns) + 2;
    uint64_t w, window;
    uint32_t levels = 1;

    if (wheel_bits == 0 || wheel_bits >= 32 || tick_ns <= 0)
        return SHMW_MAX_LEVELS + 1;   /* no such wheel */
    w = 1ULL << wheel_bits;
    window = w - 1;

    while (window <= need && levels < SHMW_MAX_LEVELS) {
        if (window > UINT64_MAX / w)
            return levels + 1;  /* the next level covers every uint64_t */
        window *= w;
        levels++;
    }
    return levels;
}

uint32_t shmw_slot_bits(uint32_t capacity)
{
    uint32_t bits = 0;

    while (bits < 32 && (1ULL << bits) < capacity)
        bits++;
    return bits;
}

int shmw_seconds_to_ns(double seconds, int64_t *out)
{
    double ns;

    if (isnan(seconds) || isinf(seconds) || seconds < 0)
        return SHMW_ETIME;
    ns = nearbyint(seconds * 1e9);
    if (ns >= 9.2e18)           /* just under INT64_MAX */
        return SHMW_ERANGE;
    *out = (int64_t)ns;
    return SHMW_OK;
}

int64_t shmw_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);  /* vDSO: no system call */
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---- segment lifetime --------------------------------------------------- */

static int check_params(const struct shmw_params *p)
{
    if (p->capacity < 1 || p->capacity > SHMW_MAX_CAPACITY)
        return SHMW_EINVAL;
    if (p->payload_size > SHMW_MAX_PAYLOAD)
        return SHMW_EINVAL;
    if (p->wheel_bits < SHMW_MIN_WHEEL_BITS || p->wheel_bits > SHMW_MAX_WHEEL_BITS)
        return SHMW_EINVAL;
    if (p->tick_ns < SHMW_MIN_TICK_NS || p->tick_ns > SHMW_MAX_TICK_NS)
        return SHMW_EINVAL;
    if (shmw_levels_for(p->tick_ns, p->wheel_bits) > SHMW_MAX_LEVELS)
        return SHMW_EINVAL;
    return SHMW_OK;
}

struct layout {
    uint64_t buckets_off;
    uint64_t heap_off;
    uint64_t lists_off;
    uint64_t slab_off;
    uint64_t size;
    uint32_t stride;
    uint32_t nbuckets;
    uint32_t levels;
};

static void compute_layout(const struct shmw_params *p, struct layout *l)
{
    l->levels = shmw_levels_for(p->tick_ns, p->wheel_bits);
    l->nbuckets = l->levels << p->wheel_bits;
    l->stride = (uint32_t)ALIGN_UP(sizeof(struct shmw_entry) + p->payload_size, 8);
    l->buckets_off = ALIGN_UP(sizeof(struct shmw_header), 64);
    l->heap_off = l->buckets_off + (uint64_t)l->nbuckets * sizeof(struct shmw_bucket);
    l->lists_off = ALIGN_UP(l->heap_off + (uint64_t)l->nbuckets * sizeof(uint32_t), 64);
    l->slab_off = l->lists_off + (uint64_t)SHMW_LANES * l->nbuckets * sizeof(struct shmw_list);
    l->size = l->slab_off + (uint64_t)p->capacity * l->stride;
}

int shmw_segment_size(const struct shmw_params *p, uint64_t *size)
{
    struct layout l;
    int rc = check_params(p);

    if (rc)
        return rc;
    compute_layout(p, &l);
    *size = l.size;
    return SHMW_OK;
}

static inline struct shmw_entry *entry_at(const shmw_t *w, uint32_t i)
{
    return (struct shmw_entry *)(w->slab + (uint64_t)i * w->stride);
}

int shmw_init(void *base, uint64_t size, const struct shmw_params *p, int64_t now_ns)
{
    struct shmw_header *h = base;
    pthread_mutexattr_t attr;
    struct layout l;
    char *slab;
    uint32_t i;
    int rc = check_params(p);

    if (rc)
        return rc;
    compute_layout(p, &l);
    if (size < l.size)
        return SHMW_ESIZE;

    /* A fresh tmpfs segment reads as zeroes; clear anyway so that init
     * over reused memory gives the same state. */
    memset(base, 0, l.slab_off);
    h->version = SHMW_LAYOUT_VERSION;
    h->header_size = sizeof(struct shmw_header);
    h->entry_size = sizeof(struct shmw_entry);
    h->bucket_size = sizeof(struct shmw_bucket);
    h->mutex_size = sizeof(pthread_mutex_t);
    h->segment_size = l.size;
    h->tick_ns = p->tick_ns;
    h->capacity = p->capacity;
    h->payload_size = p->payload_size;
    h->wheel_bits = p->wheel_bits;
    h->levels = l.levels;
    h->slot_bits = shmw_slot_bits(p->capacity);
    h->stride = l.stride;
    h->created_ns = now_ns;
    pthread_once(&pid_once, pid_init);
    h->creator_pid = cached_pid;
    /* Not secret, only different from wheel to wheel: without getrandom
     * (before Linux 3.17) the creation time and pid will do. */
    if (getrandom(&h->handle_key, sizeof(h->handle_key), GRND_NONBLOCK) != (ssize_t)sizeof(h->handle_key))
        h->handle_key = (uint64_t)now_ns * 0x9e3779b97f4a7c15ULL ^ (uint64_t)cached_pid;

    h->elapsed = shmw_ticks_ceil(now_ns, p->tick_ns);
    for (i = 0; i < l.levels; i++)
        h->level_clock[i] = shmw_bucket_expiry(h->elapsed, i, p->wheel_bits);

    for (i = 0; i < l.nbuckets; i++)
        ((struct shmw_bucket *)((char *)base + l.buckets_off))[i].heap_pos = SHMW_NIL;
    for (i = 0; i < SHMW_LANES * l.nbuckets; i++) {
        struct shmw_list *ls = (struct shmw_list *)((char *)base + l.lists_off) + i;
        ls->head = ls->tail = SHMW_NIL;
    }
    for (i = 0; i < SHMW_LANES; i++)
        h->lanes[i].free_head = SHMW_NIL;

    /* The shared free list in index order, so that a new wheel hands out
     * slots 0, 1, 2...: a lane's first magazine is slots 0 to 31. */
    slab = (char *)base + l.slab_off;
    for (i = 0; i < p->capacity; i++) {
        struct shmw_entry *e = (struct shmw_entry *)(slab + (uint64_t)i * l.stride);
        memset(e, 0, sizeof(*e));
        e->generation = 0;      /* the first handle of a slot has generation 1 */
        e->producer = SHMW_NO_PRODUCER;
        e->state = SHMW_FREE;
        e->next = (i + 1 < p->capacity) ? i + 1 : SHMW_NIL;
        e->prev = e->bucket = SHMW_NIL;
    }
    h->free_head = 0;
    h->free_count = p->capacity;
    h->inflight_head = h->inflight_tail = h->inflight_unsent = SHMW_NIL;
    h->advanced_ns = now_ns;

    /* Robust: a holder that dies hands EOWNERDEAD to the next locker
     * instead of blocking everyone.  No priority inheritance: it would put
     * a system call into every unlock. */
    if (pthread_mutexattr_init(&attr))
        return SHMW_ELOCK;
    rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED)
      || pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST)
      || pthread_mutex_init(&h->mutex, &attr);
    pthread_mutexattr_destroy(&attr);
    if (rc)
        return SHMW_ELOCK;

    __atomic_store_n(&h->magic, SHMW_MAGIC, __ATOMIC_RELEASE);
    return SHMW_OK;
}

int shmw_open(void *base, uint64_t size, shmw_t **out)
{
    struct shmw_header *h = base;
    struct shmw_params p;
    struct layout l;
    shmw_t *w;

    if (size < sizeof(uint64_t) || __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != SHMW_MAGIC)
        return SHMW_EMAGIC;
    /* The version first (it sits right after the magic): another version
     * may have another header size. */
    if (size < offsetof(struct shmw_header, version) + sizeof(h->version))
        return SHMW_ESIZE;
    if (h->version != SHMW_LAYOUT_VERSION)
        return SHMW_EVERSION;
    if (size < sizeof(struct shmw_header))
        return SHMW_ESIZE;
    if (h->header_size != sizeof(struct shmw_header)
        || h->entry_size != sizeof(struct shmw_entry)
        || h->bucket_size != sizeof(struct shmw_bucket)
        || h->mutex_size != sizeof(pthread_mutex_t))
        return SHMW_EABI;

    p.capacity = h->capacity;
    p.payload_size = h->payload_size;
    p.wheel_bits = h->wheel_bits;
    p.tick_ns = h->tick_ns;
    if (check_params(&p))
        return SHMW_ECORRUPT;
    compute_layout(&p, &l);
    if (h->levels != l.levels || h->stride != l.stride
        || h->slot_bits != shmw_slot_bits(p.capacity) || h->segment_size != l.size)
        return SHMW_ECORRUPT;
    if (size < l.size)
        return SHMW_ESIZE;

    w = calloc(1, sizeof(*w));
    if (!w)
        return SHMW_ENOMEM;
    w->base = base;
    w->hdr = h;
    w->buckets = (struct shmw_bucket *)((char *)base + l.buckets_off);
    w->heap = (uint32_t *)((char *)base + l.heap_off);
    w->lists = (struct shmw_list *)((char *)base + l.lists_off);
    w->slab = (char *)base + l.slab_off;
    w->size = l.size;
    w->tick_ns = p.tick_ns;
    w->capacity = p.capacity;
    w->payload_size = p.payload_size;
    w->wheel_bits = p.wheel_bits;
    w->wheel_mask = (1U << p.wheel_bits) - 1;
    w->levels = l.levels;
    w->nbuckets = l.nbuckets;
    w->slot_bits = shmw_slot_bits(p.capacity);
    w->stride = l.stride;
    w->max_generation = (1ULL << (63 - w->slot_bits)) - 1;
    w->handle_key = h->handle_key & w->max_generation;
    w->lock_timeout_ns = SHMW_LOCK_TIMEOUT_NS;
    w->producer = SHMW_NO_PRODUCER;
    pthread_once(&pid_once, pid_init);
    *out = w;
    return SHMW_OK;
}

void shmw_close(shmw_t *w)
{
    free(w);
}

int shmw_layout(shmw_t *w, uint64_t *buckets_off, uint64_t *heap_off, uint64_t *lists_off,
                uint64_t *slab_off)
{
    if (!w)
        return SHMW_ECLOSED;
    *buckets_off = (uint64_t)((char *)w->buckets - w->base);
    *heap_off = (uint64_t)((char *)w->heap - w->base);
    *lists_off = (uint64_t)((char *)w->lists - w->base);
    *slab_off = (uint64_t)(w->slab - w->base);
    return SHMW_OK;
}

/* ---- locking ------------------------------------------------------------- */

static int check_locked(shmw_t *w, char *reason, uint32_t reason_len);

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

/* Whether a busy mutex is worth another trylock.  glibc keeps the owner's
 * thread ID in the first word of a robust mutex (0 when free; only the
 * OWNER_DIED bit once its owner is gone); a plain load of it leaves the
 * cache line shared with the holder, where a trylock would take it away
 * and slow the very hold we are waiting out. */
static inline int mutex_may_be_free(pthread_mutex_t *m)
{
#ifdef __GLIBC__
    return (__atomic_load_n(&m->__data.__lock, __ATOMIC_RELAXED) & FUTEX_TID_MASK) == 0;
#else
    (void)m;
    return 1;
#endif
}

static int repair_locked(shmw_t *w, int64_t clock_limit_ns, char *reason, uint32_t reason_len);

/* Takes the lock, repairing what a holder that died left; does not look at
 * the damaged flag (lock() does). */
static int lock_raw(shmw_t *w)
{
    /* Uncontended, trylock is the whole cost.  Contended, spin briefly
     * first: a producer's hold is a few dozen nanoseconds, and sleeping on
     * the futex costs a system call and a context switch on each side -
     * worse, every sleeper turns the next unlock into a FUTEX_WAKE, so
     * busy producers end up queueing behind each other (a lock convoy;
     * two processes adding flat out get fewer adds done than one).  Only
     * then wait, at most SHMW_LOCK_TIMEOUT_NS: no holder keeps the lock
     * that long (every hold is bounded), so a lock not taken by then is
     * jammed - its word scribbled to name a thread that never existed,
     * say - and waiting on would hang every process. */
    pthread_mutex_t *m = &w->hdr->mutex;
    int rc = pthread_mutex_trylock(m);
    uint32_t spins;

    for (spins = 0; rc == EBUSY && spins < SHMW_LOCK_SPINS; spins++) {
        cpu_relax();
        if (mutex_may_be_free(m))
            rc = pthread_mutex_trylock(m);
    }
    if (rc == EBUSY) {
        int64_t until = shmw_now_ns() + w->lock_timeout_ns;
        struct timespec ts = { until / 1000000000LL, until % 1000000000LL };
        rc = pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &ts);
    }

    if (rc == EOWNERDEAD) {
        /* The previous holder died inside a critical section: rebuild what
         * it may have left half-made, then mark the mutex consistent, so
         * that nobody ever sees ENOTRECOVERABLE.  If the repairer dies
         * too, the next locker gets EOWNERDEAD and repairs again.  Only a
         * segment repair cannot make sense of stays flagged damaged. */
        if (repair_locked(w, -1, NULL, 0) != SHMW_OK)
            STORE(w->hdr->flags, w->hdr->flags | SHMW_F_DAMAGED);
        pthread_mutex_consistent(&w->hdr->mutex);
        rc = 0;
    }
    return rc ? SHMW_ELOCK : SHMW_OK;
}

static int lock(shmw_t *w)
{
    int rc = lock_raw(w);

    if (rc)
        return rc;
    if (w->hdr->flags & SHMW_F_DAMAGED) {
        pthread_mutex_unlock(&w->hdr->mutex);
        return SHMW_ECORRUPT;
    }
    return SHMW_OK;
}

static inline void unlock(shmw_t *w)
{
    pthread_mutex_unlock(&w->hdr->mutex);
}

int shmw_set_lock_timeout(shmw_t *w, int64_t timeout_ns)
{
    if (!w)
        return SHMW_ECLOSED;
    if (timeout_ns <= 0)
        return SHMW_EINVAL;
    w->lock_timeout_ns = timeout_ns;
    return SHMW_OK;
}

int32_t shmw_lock_holder(shmw_t *w)
{
    /* The thread ID glibc keeps in a robust mutex's lock word, as the
     * holder's own PID namespace numbers it; read without the lock, so it
     * may be stale by the time the caller looks the thread up. */
    if (!w)
        return 0;
#ifdef __GLIBC__
    return (int32_t)(__atomic_load_n(&w->hdr->mutex.__data.__lock, __ATOMIC_RELAXED) & FUTEX_TID_MASK);
#else
    return 0;
#endif
}

/* ---- futexes -------------------------------------------------------------- */

static long futex(uint32_t *word, int op, uint32_t val, const struct timespec *ts)
{
    return syscall(SYS_futex, word, op, val, ts, NULL, FUTEX_BITSET_MATCH_ANY);
}

static void futex_wake_all(uint32_t *word)
{
    futex(word, FUTEX_WAKE, INT32_MAX, NULL);
}

/* Sleeps while *word == seen, until the absolute CLOCK_MONOTONIC time
 * deadline_ns (< 0: no limit).  Returns at once if the word has moved on. */
static void futex_wait_until(uint32_t *word, uint32_t seen, int64_t deadline_ns)
{
    struct timespec ts;

    if (deadline_ns < 0) {
        futex(word, FUTEX_WAIT_BITSET, seen, NULL);
        return;
    }
    ts.tv_sec = deadline_ns / 1000000000LL;
    ts.tv_nsec = deadline_ns % 1000000000LL;
    futex(word, FUTEX_WAIT_BITSET, seen, &ts);
}

/* ---- the delay-heap ------------------------------------------------------
 * A binary min-heap of bucket indices keyed by bucket expiry.  Each bucket
 * records its position so cancel can remove it in O(log B).  The callers
 * have checked every index they pass; indices read back from the heap
 * array are checked here. */

static inline int heap_less(const shmw_t *w, uint32_t a, uint32_t b)
{
    return w->buckets[a].expires < w->buckets[b].expires;
}

static void heap_place(shmw_t *w, uint32_t pos, uint32_t b)
{
    STORE(w->heap[pos], b);
    STORE(w->buckets[b].heap_pos, pos);
}

static int sift_up(shmw_t *w, uint32_t pos)
{
    uint32_t b;

    if (pos >= w->nbuckets || (b = w->heap[pos]) >= w->nbuckets)
        return SHMW_ECORRUPT;
    while (pos > 0) {
        uint32_t parent = (pos - 1) / 2;
        uint32_t pb = w->heap[parent];
        if (pb >= w->nbuckets)
            return SHMW_ECORRUPT;
        if (!heap_less(w, b, pb))
            break;
        heap_place(w, pos, pb);
        pos = parent;
    }
    heap_place(w, pos, b);
    return SHMW_OK;
}

static int sift_down(shmw_t *w, uint32_t pos, uint32_t len)
{
    uint32_t b = w->heap[pos];

    for (;;) {
        uint32_t child = 2 * pos + 1;
        uint32_t cb;
        if (child >= len)
            break;
        cb = w->heap[child];
        if (cb >= w->nbuckets)
            return SHMW_ECORRUPT;
        if (child + 1 < len) {
            uint32_t rb = w->heap[child + 1];
            if (rb >= w->nbuckets)
                return SHMW_ECORRUPT;
            if (heap_less(w, rb, cb)) {
                child++;
                cb = rb;
            }
        }
        if (!heap_less(w, cb, b))
            break;
        heap_place(w, pos, cb);
        pos = child;
    }
    heap_place(w, pos, b);
    return SHMW_OK;
}

static int heap_push(shmw_t *w, uint32_t b)
{
    uint32_t len = w->hdr->heap_len;

    if (len >= w->nbuckets)
        return SHMW_ECORRUPT;
    STORE(w->heap[len], b);
    STORE(w->hdr->heap_len, len + 1);
    return sift_up(w, len);
}

static int heap_remove(shmw_t *w, uint32_t b)
{
    uint32_t pos = w->buckets[b].heap_pos;
    uint32_t len = w->hdr->heap_len;
    uint32_t last;
    int rc;

    if (len == 0 || len > w->nbuckets || pos >= len || w->heap[pos] != b)
        return SHMW_ECORRUPT;
    len--;
    STORE(w->hdr->heap_len, len);
    STORE(w->buckets[b].heap_pos, SHMW_NIL);
    if (pos == len)
        return SHMW_OK;
    last = w->heap[len];
    if (last >= w->nbuckets)
        return SHMW_ECORRUPT;
    heap_place(w, pos, last);
    rc = sift_down(w, pos, len);
    if (rc)
        return rc;
    pos = w->buckets[last].heap_pos;    /* read back: where sift_down left it */
    return pos < len ? sift_up(w, pos) : SHMW_ECORRUPT;
}

/* ---- buckets --------------------------------------------------------------- */

/* Where a timer due at tick t goes with the wheel clock at `elapsed`.  A
 * timer at or before the clock goes to the clock's own level-0 bucket: it
 * is due at the next poll. */
static int place(const shmw_t *w, uint64_t elapsed, uint64_t t, uint32_t *bucket, uint64_t *expires)
{
    uint64_t key = t > elapsed ? t : elapsed;
    uint32_t level = shmw_level_for(elapsed, key, w->wheel_bits);

    if (level >= w->levels)
        return SHMW_ERANGE;
    *bucket = (level << w->wheel_bits) | shmw_slot_for(key, level, w->wheel_bits);
    *expires = shmw_bucket_expiry(key, level, w->wheel_bits);
    return SHMW_OK;
}

static inline uint32_t lane_of(uint32_t producer)
{
    return producer % SHMW_LANES;
}

/* The producer slot this process's timers are filed under: its own, or
 * none in a child forked since attach (it shares no slot with its parent). */
static inline uint16_t my_producer(const shmw_t *w)
{
    return (uint16_t)(w->producer_pid == cached_pid ? w->producer : SHMW_NO_PRODUCER);
}

static inline struct shmw_list *list_of(const shmw_t *w, uint32_t lane, uint32_t b)
{
    return &w->lists[(uint64_t)lane * w->nbuckets + b];
}

/* Whether lane `lane` of bucket b can take an entry due at `expires`.
 * Operations check this before they change anything, so that one that
 * fails on a scribbled segment leaves it as it was. */
static int bucket_can_take(const shmw_t *w, uint32_t b, uint32_t lane, uint64_t expires)
{
    const struct shmw_bucket *bk = &w->buckets[b];
    const struct shmw_list *ls = list_of(w, lane, b);
    uint32_t bit = 1U << lane;

    if (bk->lanes >> SHMW_LANES)
        return SHMW_ECORRUPT;
    if (bk->lanes == 0 && (bk->heap_pos != SHMW_NIL || w->hdr->heap_len >= w->nbuckets))
        return SHMW_ECORRUPT;
    if (bk->lanes != 0 && (bk->expires != expires || bk->heap_pos >= w->nbuckets))
        return SHMW_ECORRUPT;
    if (!(bk->lanes & bit))
        return ls->head == SHMW_NIL && ls->tail == SHMW_NIL && ls->count == 0 ? SHMW_OK : SHMW_ECORRUPT;
    return ls->count > 0 && ls->tail < w->capacity ? SHMW_OK : SHMW_ECORRUPT;
}

/* Appends entry i, whose producer is already set, to its lane's list of
 * bucket b; the caller has checked bucket_can_take. */
static int bucket_append(shmw_t *w, uint32_t b, uint64_t expires, uint32_t i)
{
    struct shmw_bucket *bk = &w->buckets[b];
    struct shmw_entry *e = entry_at(w, i);
    uint32_t lane = lane_of(e->producer), bit = 1U << lane;
    struct shmw_list *ls = list_of(w, lane, b);

    if (bk->lanes & bit) {
        if (ls->tail >= w->capacity || bk->expires != expires)
            return SHMW_ECORRUPT;
        STORE(entry_at(w, ls->tail)->next, i);
        STORE(e->prev, ls->tail);
        STORE(e->next, SHMW_NIL);
        STORE(e->bucket, b);
        STORE(ls->tail, i);
        STORE(ls->count, ls->count + 1);
        return SHMW_OK;
    }
    if (ls->count != 0 || (bk->lanes == 0 ? bk->heap_pos != SHMW_NIL : bk->expires != expires))
        return SHMW_ECORRUPT;
    STORE(e->prev, SHMW_NIL); STORE(e->next, SHMW_NIL);
    STORE(e->bucket, b);
    STORE(ls->head, i); STORE(ls->tail, i);
    STORE(ls->count, 1);
    if (bk->lanes != 0) {
        STORE(bk->lanes, bk->lanes | bit);
        return SHMW_OK;
    }
    STORE(bk->expires, expires);
    STORE(bk->lanes, bit);
    return heap_push(w, b);
}

/* Takes entry i out of the doubly linked list whose ends are *head and
 * *tail (a bucket's, or the in-flight FIFO).  Checks the links around i
 * before touching anything, so a scribbled list is reported, not made
 * worse. */
static int list_unlink(shmw_t *w, uint32_t *head, uint32_t *tail, uint32_t i)
{
    struct shmw_entry *e = entry_at(w, i);

    if (e->prev == SHMW_NIL ? *head != i
        : e->prev >= w->capacity || entry_at(w, e->prev)->next != i)
        return SHMW_ECORRUPT;
    if (e->next == SHMW_NIL ? *tail != i
        : e->next >= w->capacity || entry_at(w, e->next)->prev != i)
        return SHMW_ECORRUPT;

    if (e->prev == SHMW_NIL)
        STORE(*head, e->next);
    else
        STORE(entry_at(w, e->prev)->next, e->next);
    if (e->next == SHMW_NIL)
        STORE(*tail, e->prev);
    else
        STORE(entry_at(w, e->next)->prev, e->prev);
    STORE(e->prev, SHMW_NIL); STORE(e->next, SHMW_NIL);
    return SHMW_OK;
}

/* Whether neighbour n of an entry in lane `lane` of bucket b is in that
 * list too.  The lane comes from the entry's own producer field: scribbled,
 * it would name another lane's list, whose count the unlink would then
 * take down while the entry's real neighbours still agree with each
 * other.  Costs nothing: list_unlink reads these entries anyway. */
static inline int same_list(const shmw_t *w, uint32_t n, uint32_t lane, uint32_t b)
{
    return n == SHMW_NIL
        || (n < w->capacity && lane_of(entry_at(w, n)->producer) == lane && entry_at(w, n)->bucket == b);
}

static int bucket_unlink(shmw_t *w, uint32_t i)
{
    struct shmw_entry *e = entry_at(w, i);
    uint32_t b = e->bucket, lane = lane_of(e->producer), bit = 1U << lane;
    struct shmw_bucket *bk;
    struct shmw_list *ls;

    if (b >= w->nbuckets || !same_list(w, e->prev, lane, b) || !same_list(w, e->next, lane, b))
        return SHMW_ECORRUPT;
    bk = &w->buckets[b];
    ls = list_of(w, lane, b);
    if (ls->count == 0 || !(bk->lanes & bit) || bk->lanes >> SHMW_LANES)
        return SHMW_ECORRUPT;
    if (list_unlink(w, &ls->head, &ls->tail, i))
        return SHMW_ECORRUPT;
    STORE(e->bucket, SHMW_NIL);
    STORE(ls->count, ls->count - 1);
    if (ls->count > 0)
        return SHMW_OK;
    STORE(ls->head, SHMW_NIL); STORE(ls->tail, SHMW_NIL);
    STORE(bk->lanes, bk->lanes & ~bit);
    return bk->lanes == 0 ? heap_remove(w, b) : SHMW_OK;
}

/* ---- the slab ------------------------------------------------------------------ */

/* A handle from a slab index and the generation bits, and back.  The
 * caller has checked that the entry's generation is at most max_generation
 * (entry_sane), which keeps the handle below 2^63. */
static inline int64_t handle_of(const shmw_t *w, uint32_t i)
{
    return (int64_t)((entry_at(w, i)->generation ^ w->handle_key) << w->slot_bits | i);
}

/* The slab index a handle names (maybe out of bounds: the caller checks),
 * and the generation it expects there. */
static inline uint32_t handle_index(const shmw_t *w, int64_t handle)
{
    return (uint32_t)((uint64_t)handle & ((1ULL << w->slot_bits) - 1));
}

static inline uint64_t handle_generation(const shmw_t *w, int64_t handle)
{
    return ((uint64_t)handle >> w->slot_bits) ^ w->handle_key;
}

/* The entry a handle names if it is in `state`, or NIL. */
static uint32_t lookup(const shmw_t *w, int64_t handle, uint8_t state)
{
    uint32_t i = handle_index(w, handle);
    struct shmw_entry *e;

    if (i >= w->capacity)
        return SHMW_NIL;
    e = entry_at(w, i);
    if (e->state != state || e->generation != handle_generation(w, handle))
        return SHMW_NIL;
    return i;
}

/* Whether what a pending or in-flight entry says about itself can be
 * turned into a fire: a generation that makes a handle, a payload length
 * within the slot, a deadline that is a time, known flags, a producer slot
 * that exists, and, once fired, a firing time not before the deadline.  An
 * entry that fails is never handed out: the operation that meets it
 * reports SHMW_ECORRUPT, and a repair retires it. */
static int entry_sane(const shmw_t *w, const struct shmw_entry *e)
{
    return e->generation != 0 && e->generation <= w->max_generation
        && e->payload_len <= w->payload_size && e->deadline_ns >= 0
        && !(e->flags & ~(SHMW_REDELIVERED | SHMW_CANCEL_ON_EXIT | SHMW_SENT))
        && (e->producer < SHMW_MAX_PRODUCERS || e->producer == SHMW_NO_PRODUCER)
        && (e->state != SHMW_INFLIGHT || e->fired_at_ns >= e->deadline_ns);
}

/* ---- free slots ------------------------------------------------------------
 * A lane's magazine is a LIFO: a process gets back the slot it freed last,
 * whose line its CPU still has.  An empty magazine takes SHMW_MAGAZINE
 * slots from the shared list (or, when that is empty too, from another
 * lane: no slot is ever out of reach); one that reaches 2 * SHMW_MAGAZINE
 * gives SHMW_MAGAZINE back.  Each move walks SHMW_MAGAZINE links, once
 * every SHMW_MAGAZINE operations at most: O(1) amortised.  free_count in
 * the header is the total, so that "is there room" is one load. */

/* Cuts up to `max` (<= SHMW_MAGAZINE) slots off the free list at *head,
 * fewer only where it ends, and gives the first and the last; `exact`:
 * the list must hold `max`.  One walk checks them all, and the link left
 * behind, before anything changes: ECORRUPT if a slot is not free or a
 * link is out of bounds.  Returns how many (0: the list is empty). */
static int chain_cut(shmw_t *w, uint32_t *head, uint32_t max, int exact, uint32_t *first, uint32_t *last)
{
    uint32_t i = *head, prev = SHMW_NIL, n = 0;

    while (n < max && i != SHMW_NIL) {
        if (i >= w->capacity || entry_at(w, i)->state != SHMW_FREE)
            return SHMW_ECORRUPT;
        prev = i;
        i = entry_at(w, i)->next;
        n++;
    }
    if ((i != SHMW_NIL && i >= w->capacity) || (exact && n < max))
        return SHMW_ECORRUPT;
    if (n == 0)
        return 0;
    *first = *head;
    *last = prev;
    STORE(*head, i);
    STORE(entry_at(w, prev)->next, SHMW_NIL);
    return (int)n;
}

/* Fills the empty magazine of `lane`: from the shared list, or, when that
 * is empty too (the wheel is nearly full), from the first lane with any. */
static int magazine_refill(shmw_t *w, struct shmw_lane *lane)
{
    struct shmw_header *h = w->hdr;
    uint32_t first = SHMW_NIL, last, k;
    int n;

    if (lane->free_head != SHMW_NIL)
        return SHMW_ECORRUPT;
    n = chain_cut(w, &h->free_head, SHMW_MAGAZINE, 0, &first, &last);
    if (n == 0) {
        for (k = 0; k < SHMW_LANES && h->lanes[k].free_count == 0; k++)
            ;
        if (k == SHMW_LANES)
            return SHMW_ECORRUPT;           /* free_count said there were some */
        n = chain_cut(w, &h->lanes[k].free_head,
                      h->lanes[k].free_count < SHMW_MAGAZINE ? h->lanes[k].free_count : SHMW_MAGAZINE, 1,
                      &first, &last);
        if (n > 0)
            STORE(h->lanes[k].free_count, h->lanes[k].free_count - (uint32_t)n);
    }
    if (n < 0)
        return n;
    STORE(lane->free_head, first);
    STORE(lane->free_count, (uint32_t)n);
    return SHMW_OK;
}

/* Gives the top SHMW_MAGAZINE slots of a full magazine back to the shared
 * list.  A magazine that does not walk is left as it is, for check to
 * report: nothing has been lost yet. */
static void magazine_spill(shmw_t *w, struct shmw_lane *lane)
{
    struct shmw_header *h = w->hdr;
    uint32_t first, last;

    if (chain_cut(w, &lane->free_head, SHMW_MAGAZINE, 1, &first, &last) != (int)SHMW_MAGAZINE)
        return;
    STORE(lane->free_count, lane->free_count - SHMW_MAGAZINE);
    STORE(entry_at(w, last)->next, h->free_head);
    STORE(h->free_head, first);
}

/* Generations go up when a slot is handed out, not when it is freed: a
 * process that dies between the two stores of either leaves a slot whose
 * next handle is still new.  A slot whose generation has reached the
 * maximum is retired when freed instead of reused.  A freed slot goes to
 * the magazine of the process that frees it. */
static void slot_free(shmw_t *w, uint32_t i)
{
    struct shmw_entry *e = entry_at(w, i);
    struct shmw_header *h = w->hdr;
    struct shmw_lane *lane = &h->lanes[lane_of(my_producer(w))];

    STORE(e->prev, SHMW_NIL); STORE(e->bucket, SHMW_NIL);
    STORE(e->flags, 0);
    if (e->generation >= w->max_generation) {
        STORE(e->next, SHMW_NIL);
        COMMIT(e->state, SHMW_RETIRED);
        STORE(h->retired, h->retired + 1);
        return;
    }
    STORE(e->next, lane->free_head);
    COMMIT(e->state, SHMW_FREE);
    STORE(lane->free_head, i);
    STORE(lane->free_count, lane->free_count + 1);
    STORE(h->free_count, h->free_count + 1);
    if (lane->free_count >= 2 * SHMW_MAGAZINE)
        magazine_spill(w, lane);
}

/* Takes a free slot for a timer of lane `lane_no`, from its magazine. */
static int slot_alloc(shmw_t *w, uint32_t lane_no, uint32_t *out)
{
    struct shmw_header *h = w->hdr;
    struct shmw_lane *lane = &h->lanes[lane_no];
    struct shmw_entry *e;
    uint32_t i;
    int rc;

    if (h->free_count == 0)
        return SHMW_EFULL;
    if (lane->free_count == 0 && (rc = magazine_refill(w, lane)))
        return rc;
    i = lane->free_head;
    if (i >= w->capacity)
        return SHMW_ECORRUPT;
    e = entry_at(w, i);
    if (e->state != SHMW_FREE || (e->next != SHMW_NIL && e->next >= w->capacity)
        || e->generation >= w->max_generation)
        return SHMW_ECORRUPT;   /* a bad generation would make a negative handle */
    STORE(lane->free_head, e->next);
    STORE(lane->free_count, lane->free_count - 1);
    STORE(h->free_count, h->free_count - 1);
    STORE(e->generation, e->generation + 1);
    *out = i;
    return SHMW_OK;
}

/* The clock sleeps until h->sleep_until (0 while it is awake or there is
 * no driver).  A timer due before that must wake it: the word is bumped
 * here, under the lock, and the caller calls FUTEX_WAKE after unlocking.
 * Lowering sleep_until makes later adds for the same moment skip the
 * system call. */
static int wake_for(shmw_t *w, uint64_t expires)
{
    struct shmw_header *h = w->hdr;

    if (expires >= h->sleep_until)
        return 0;
    STORE(h->sleep_until, expires);
    __atomic_add_fetch(&h->wake_word, 1, __ATOMIC_SEQ_CST);
    return 1;
}

static void wake_clock(shmw_t *w)
{
    futex_wake_all(&w->hdr->wake_word);
}

/* Takes a free slot, fills it and puts it in its bucket.  On failure the
 * slot goes back to the free list untouched. */
static int insert_new(shmw_t *w, int64_t deadline_ns, const char *payload, uint32_t len, uint32_t flags,
                      int64_t *handle, int *wake)
{
    struct shmw_header *h = w->hdr;
    struct shmw_entry *e;
    uint16_t producer = my_producer(w);
    uint64_t expires;
    uint32_t i, b;
    int rc;

    rc = place(w, h->elapsed, shmw_ticks_ceil(deadline_ns, w->tick_ns), &b, &expires);
    if (rc == SHMW_OK)
        rc = bucket_can_take(w, b, lane_of(producer), expires);
    if (rc == SHMW_OK)
        rc = slot_alloc(w, lane_of(producer), &i);
    if (rc)
        return rc;
    e = entry_at(w, i);
    STORE(e->deadline_ns, deadline_ns);
    STORE(e->owner_pid, cached_pid);
    STORE(e->payload_len, len);
    STORE(e->flags, (uint8_t)(flags & SHMW_CANCEL_ON_EXIT));
    STORE(e->producer, producer);
    if (len) {
        crash_point();
        memcpy((char *)(e + 1), payload, len);
    }
    COMMIT(e->state, SHMW_PENDING);          /* commits the entry */
    rc = bucket_append(w, b, expires, i);
    if (rc)
        return rc;
    STORE(h->added, h->added + 1);
    *wake |= wake_for(w, expires);
    *handle = handle_of(w, i);
    return SHMW_OK;
}

/* ---- operations --------------------------------------------------------------------- */

/* The deadline for a delay, checked against the maximum; no lock. */
static int deadline_after(double delay_s, int64_t now_ns, int64_t *deadline_ns)
{
    int64_t delay_ns;
    int rc = shmw_seconds_to_ns(delay_s, &delay_ns);

    if (rc)
        return rc;
    if (delay_ns > SHMW_MAX_DELAY_NS)
        return SHMW_ERANGE;
    *deadline_ns = now_ns + delay_ns;
    return SHMW_OK;
}

static int deadline_at(double deadline_s, int64_t now_ns, int64_t *deadline_ns)
{
    int rc = shmw_seconds_to_ns(deadline_s, deadline_ns);

    if (rc)
        return rc;
    if (*deadline_ns > now_ns && *deadline_ns - now_ns > SHMW_MAX_DELAY_NS)
        return SHMW_ERANGE;
    return SHMW_OK;
}

static int64_t add_checked(shmw_t *w, int64_t deadline_ns, const char *payload, uint32_t len, uint32_t flags)
{
    int64_t handle = 0;
    int rc, wake = 0;

    if (!w)
        return SHMW_ECLOSED;
    if (len > w->payload_size)
        return SHMW_EPAYLOAD;
    if (flags & ~(uint32_t)SHMW_CANCEL_ON_EXIT)
        return SHMW_EINVAL;
    /* Cancel-on-exit needs this process's own producer slot; after a fork
     * the slot is the parent's, so the caller must attach again. */
    if ((flags & SHMW_CANCEL_ON_EXIT) && my_producer(w) == SHMW_NO_PRODUCER)
        return SHMW_EPRODUCER;
    if ((rc = lock(w)))
        return rc;
    /* Read under the lock: an add that takes it after the mark fails, so
     * no timer goes into a segment after its remover looked. */
    rc = w->hdr->removed ? SHMW_EREMOVED : insert_new(w, deadline_ns, payload, len, flags, &handle, &wake);
    unlock(w);
    if (wake)
        wake_clock(w);
    return rc ? rc : handle;
}

int64_t shmw_add(shmw_t *w, double delay_s, const char *payload, uint32_t len, uint32_t flags)
{
    int64_t deadline_ns;
    int rc = deadline_after(delay_s, shmw_now_ns(), &deadline_ns);

    return rc ? rc : add_checked(w, deadline_ns, payload, len, flags);
}

int64_t shmw_add_at(shmw_t *w, double deadline_s, const char *payload, uint32_t len, uint32_t flags)
{
    int64_t deadline_ns;
    int rc = deadline_at(deadline_s, shmw_now_ns(), &deadline_ns);

    return rc ? rc : add_checked(w, deadline_ns, payload, len, flags);
}

int shmw_add_many(shmw_t *w, const double *delays, uint32_t n,
                  const char *payloads, const uint32_t *lens, int64_t *handles)
{
    /* All or nothing: every argument is checked and the free count is
     * checked before the first insert.  The deadlines are computed into
     * the caller's handle array, then overwritten by the handles. */
    int64_t now_ns = shmw_now_ns();
    uint64_t off = 0;
    uint32_t k;
    int rc, wake = 0;

    if (!w)
        return SHMW_ECLOSED;
    for (k = 0; k < n; k++) {
        if ((rc = deadline_after(delays[k], now_ns, &handles[k])))
            return rc;
        if (lens && lens[k] > w->payload_size)
            return SHMW_EPAYLOAD;
    }
    if ((rc = lock(w)))
        return rc;
    if (w->hdr->removed || w->hdr->free_count < n) {
        rc = w->hdr->removed ? SHMW_EREMOVED : SHMW_EFULL;
        unlock(w);
        return rc;
    }
    for (k = 0; k < n; k++) {
        uint32_t len = lens ? lens[k] : 0;
        rc = insert_new(w, handles[k], len ? payloads + off : NULL, len, 0, &handles[k], &wake);
        if (rc)
            break;              /* only ECORRUPT gets here */
        off += len;
    }
    unlock(w);
    if (wake)
        wake_clock(w);
    return rc;
}

static int cancel_locked(shmw_t *w, int64_t handle)
{
    uint32_t i = lookup(w, handle, SHMW_PENDING);
    int rc;

    if (i == SHMW_NIL)
        return 0;
    if ((rc = bucket_unlink(w, i)))
        return rc;
    slot_free(w, i);
    STORE(w->hdr->cancelled, w->hdr->cancelled + 1);
    return 1;
}

int shmw_cancel(shmw_t *w, int64_t handle)
{
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (handle < 0)
        return SHMW_EHANDLE;
    if ((rc = lock(w)))
        return rc;
    rc = cancel_locked(w, handle);
    unlock(w);
    return rc;
}

int shmw_cancel_many(shmw_t *w, const int64_t *handles, uint32_t n)
{
    uint32_t k;
    int rc, done = 0;

    if (!w)
        return SHMW_ECLOSED;
    for (k = 0; k < n; k++)
        if (handles[k] < 0)
            return SHMW_EHANDLE;
    if ((rc = lock(w)))
        return rc;
    for (k = 0; k < n; k++) {
        rc = cancel_locked(w, handles[k]);
        if (rc < 0)
            break;
        done += rc;
    }
    unlock(w);
    return rc < 0 ? rc : done;
}

static int reset_checked(shmw_t *w, int64_t handle, int64_t deadline_ns)
{
    struct shmw_entry *e;
    uint64_t expires;
    uint32_t i, b;
    int rc, wake = 0;

    if (!w)
        return SHMW_ECLOSED;
    if (handle < 0)
        return SHMW_EHANDLE;
    if ((rc = lock(w)))
        return rc;
    i = lookup(w, handle, SHMW_PENDING);
    if (i == SHMW_NIL) {
        unlock(w);
        return 0;
    }
    e = entry_at(w, i);
    rc = place(w, w->hdr->elapsed, shmw_ticks_ceil(deadline_ns, w->tick_ns), &b, &expires);
    if (rc == SHMW_OK && b != e->bucket)
        rc = bucket_can_take(w, b, lane_of(e->producer), expires);
    if (rc == SHMW_OK) {
        /* The new deadline first: if this process dies before the entry
         * is relinked, recovery files it by the deadline it now has. */
        STORE(e->deadline_ns, deadline_ns);
        if (!(b == e->bucket && w->buckets[b].expires == expires)) {
            rc = bucket_unlink(w, i);
            if (rc == SHMW_OK)
                rc = bucket_append(w, b, expires, i);
        }
    }
    if (rc == SHMW_OK) {
        STORE(w->hdr->resets, w->hdr->resets + 1);
        wake = wake_for(w, expires);
    }
    unlock(w);
    if (wake)
        wake_clock(w);
    return rc ? rc : 1;
}

int shmw_reset(shmw_t *w, int64_t handle, double delay_s)
{
    int64_t deadline_ns;
    int rc = deadline_after(delay_s, shmw_now_ns(), &deadline_ns);

    return rc ? rc : reset_checked(w, handle, deadline_ns);
}

int shmw_reset_at(shmw_t *w, int64_t handle, double deadline_s)
{
    int64_t deadline_ns;
    int rc = deadline_at(deadline_s, shmw_now_ns(), &deadline_ns);

    return rc ? rc : reset_checked(w, handle, deadline_ns);
}

/* A tick as a CLOCK_MONOTONIC time, saturated: a tick read back from the
 * segment may be anything, and a product that wrapped negative would read
 * as "no deadline" to the futex wait. */
static inline int64_t ticks_to_ns(const shmw_t *w, uint64_t t)
{
    return t > (uint64_t)INT64_MAX / (uint64_t)w->tick_ns ? INT64_MAX : (int64_t)(t * (uint64_t)w->tick_ns);
}

static void set_elapsed(shmw_t *w, uint64_t t, int64_t now_ns)
{
    struct shmw_header *h = w->hdr;
    uint32_t l;

    STORE(h->elapsed, t);
    STORE(h->advanced_ns, now_ns);
    for (l = 0; l < w->levels; l++)
        STORE(h->level_clock[l], shmw_bucket_expiry(t, l, w->wheel_bits));
}

int shmw_record_size(shmw_t *w)
{
    if (!w)
        return SHMW_ECLOSED;
    return (int)(sizeof(struct shmw_fire) + ALIGN_UP(w->payload_size, 8));
}

/* Fills one fire record from entry i. */
static void write_record(const shmw_t *w, uint32_t i, char *rec)
{
    struct shmw_entry *e = entry_at(w, i);
    struct shmw_fire *f = (struct shmw_fire *)rec;
    uint32_t len = e->payload_len <= w->payload_size ? e->payload_len : 0;

    f->handle = handle_of(w, i);
    f->deadline_ns = e->deadline_ns;
    f->fired_at_ns = e->fired_at_ns;
    f->owner_pid = e->owner_pid;
    f->payload_len = len;
    f->flags = e->flags & SHMW_REDELIVERED;
    f->_pad = 0;
    if (len)
        memcpy(rec + sizeof(*f), (char *)(e + 1), len);
}

/* The in-flight FIFO: append at the tail, unlink anywhere (acks may come
 * in any order).  Links are checked before anything is changed. */
/* Whether the in-flight FIFO's tail can be appended to (checked before
 * the entry leaves its bucket). */
static int inflight_can_take(const shmw_t *w)
{
    const struct shmw_header *h = w->hdr;

    if (h->inflight_tail == SHMW_NIL)
        return h->inflight == 0 && h->inflight_head == SHMW_NIL ? SHMW_OK : SHMW_ECORRUPT;
    return h->inflight > 0 && h->inflight_tail < w->capacity ? SHMW_OK : SHMW_ECORRUPT;
}

static void inflight_append(shmw_t *w, uint32_t i)
{
    struct shmw_header *h = w->hdr;
    struct shmw_entry *e = entry_at(w, i);

    COMMIT(e->state, SHMW_INFLIGHT);
    STORE(e->bucket, SHMW_NIL);
    STORE(e->next, SHMW_NIL);
    STORE(e->prev, h->inflight_tail);
    if (h->inflight_tail == SHMW_NIL)
        STORE(h->inflight_head, i);
    else
        STORE(entry_at(w, h->inflight_tail)->next, i);
    STORE(h->inflight_tail, i);
    if (h->inflight_unsent == SHMW_NIL)
        STORE(h->inflight_unsent, i);
    STORE(h->inflight, h->inflight + 1);
}

static int inflight_unlink(shmw_t *w, uint32_t i)
{
    struct shmw_header *h = w->hdr;
    struct shmw_entry *e = entry_at(w, i);

    uint32_t next = e->next;

    if (h->inflight == 0)
        return SHMW_ECORRUPT;
    if (list_unlink(w, &h->inflight_head, &h->inflight_tail, i))
        return SHMW_ECORRUPT;
    if (h->inflight_unsent == i)
        STORE(h->inflight_unsent, next);
    STORE(h->inflight, h->inflight - 1);
    return SHMW_OK;
}

/* Advances the clock towards now_tick, firing at most `max` timers: into
 * `records` and straight back to the free list (records != NULL: poll), or
 * onto the in-flight FIFO (records == NULL: the driver).  Pops due buckets
 * in expiry order.  A level-0 bucket fires whole; a higher bucket is a
 * cascade: the clock jumps to its expiry and its timers go back in, each
 * to a strictly later bucket of a lower level, or fire if due at that very
 * tick.  Entries are taken off the head one at a time, so a call that
 * stops early leaves the rest of the bucket, and the clock, where they
 * were: it stops after `max` fires or SHMW_LOCK_WORK entries moved or
 * fired, whichever comes first, and sets *more if something due is left.
 * That bounds the lock hold: cascading a million timers takes many short
 * holds, not one of tens of milliseconds. */
static int advance(shmw_t *w, uint64_t now_tick, int64_t now_ns, uint32_t max, char *records,
                   uint32_t *fired, int *more)
{
    struct shmw_header *h = w->hdr;
    uint32_t stride = sizeof(struct shmw_fire) + (uint32_t)ALIGN_UP(w->payload_size, 8);
    uint32_t n = 0, work = 0;
    int rc = SHMW_OK;

    *more = 0;
    for (;;) {
        struct shmw_bucket *bk;
        struct shmw_entry *e;
        uint32_t b, i, lanes, nb = 0;
        uint64_t at, t, expires = 0;

        if (h->heap_len > w->nbuckets || (h->heap_len > 0 && w->heap[0] >= w->nbuckets)) {
            rc = SHMW_ECORRUPT;
            break;
        }
        if (h->heap_len == 0 || w->buckets[w->heap[0]].expires > now_tick) {
            if (now_tick > h->elapsed)
                set_elapsed(w, now_tick, now_ns);
            break;
        }
        if (n == max || work == SHMW_LOCK_WORK) {
            *more = 1;
            break;
        }
        b = w->heap[0];
        bk = &w->buckets[b];
        at = bk->expires;
        lanes = bk->lanes;
        if (lanes == 0 || lanes >> SHMW_LANES) {
            rc = SHMW_ECORRUPT;
            break;
        }
        i = list_of(w, (uint32_t)__builtin_ctz(lanes), b)->head;
        if (at < h->elapsed || i >= w->capacity) {
            rc = SHMW_ECORRUPT;
            break;
        }
        e = entry_at(w, i);
        if (e->state != SHMW_PENDING || e->bucket != b || !entry_sane(w, e)) {
            rc = SHMW_ECORRUPT;
            break;
        }
        if (at > h->elapsed)
            set_elapsed(w, at, now_ns);
        work++;

        /* Check where the entry goes before it leaves its bucket. */
        t = shmw_ticks_ceil(e->deadline_ns, w->tick_ns);
        if (t > at) {
            if ((rc = place(w, at, t, &nb, &expires))
                || (rc = bucket_can_take(w, nb, lane_of(e->producer), expires)))
                break;
        } else if (!records && (rc = inflight_can_take(w))) {
            break;
        }
        if ((rc = bucket_unlink(w, i)))
            break;
        if (t > at) {
            /* Cascade. */
            if ((rc = bucket_append(w, nb, expires, i)))
                break;
            continue;
        }
        STORE(e->fired_at_ns, now_ns);
        STORE(h->fired, h->fired + 1);
        if (records) {
            write_record(w, i, records + (uint64_t)n * stride);
            slot_free(w, i);
        } else {
            inflight_append(w, i);
        }
        n++;
    }
    *fired = n;
    return rc;
}

/* Poll hands out, first, whatever a dead driver left in flight (marked
 * redelivered when its registration was released), then what is due. */
static int drain_inflight(shmw_t *w, uint32_t max, char *records, uint32_t *n)
{
    struct shmw_header *h = w->hdr;
    uint32_t stride = sizeof(struct shmw_fire) + (uint32_t)ALIGN_UP(w->payload_size, 8);
    int rc;

    *n = 0;
    while (*n < max && h->inflight_head != SHMW_NIL) {
        uint32_t i = h->inflight_head;
        if (i >= w->capacity || entry_at(w, i)->state != SHMW_INFLIGHT || !entry_sane(w, entry_at(w, i)))
            return SHMW_ECORRUPT;       /* the caller hands out the *n before it */
        write_record(w, i, records + (uint64_t)*n * stride);
        if ((rc = inflight_unlink(w, i)))
            return rc;
        slot_free(w, i);
        STORE(h->acked, h->acked + 1);
        (*n)++;
    }
    return SHMW_OK;
}

int shmw_poll(shmw_t *w, double now_s, int use_clock, uint32_t max, char *records, int *more)
{
    uint32_t stride, n = 0, fired = 0;
    uint64_t now_tick;
    int64_t now_ns;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (use_clock)
        now_ns = shmw_now_ns();
    else if ((rc = shmw_seconds_to_ns(now_s, &now_ns)))
        return rc;
    now_tick = (uint64_t)now_ns / (uint64_t)w->tick_ns;
    stride = sizeof(struct shmw_fire) + (uint32_t)ALIGN_UP(w->payload_size, 8);

    *more = 0;
    if ((rc = lock(w)))
        return rc;
    if (w->hdr->driver_pid != 0)
        rc = SHMW_EDRIVER;
    else if ((rc = drain_inflight(w, max, records, &n)) == SHMW_OK)
        rc = advance(w, now_tick, now_ns, max - n, records + (uint64_t)n * stride, &fired, more);
    unlock(w);
    /* The timers fired before an error are freed already: their records
     * must reach the caller.  The error comes again with the next call. */
    if (rc && n + fired > 0) {
        *more = 1;
        return (int)(n + fired);
    }
    return rc ? rc : (int)(n + fired);
}

/* ---- the driver ----------------------------------------------------------------- */

void shmw_wake(shmw_t *w)
{
    if (!w)
        return;
    __atomic_add_fetch(&w->hdr->wake_word, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&w->hdr->outbox_word, 1, __ATOMIC_SEQ_CST);
    futex_wake_all(&w->hdr->wake_word);
    futex_wake_all(&w->hdr->outbox_word);
}

int shmw_driver_register(shmw_t *w, int32_t pid, int64_t start, int32_t expect_pid, int64_t expect_start)
{
    struct shmw_header *h;
    uint32_t i, k;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (pid < 0)
        return SHMW_EINVAL;
    if ((rc = lock(w)))
        return rc;
    h = w->hdr;
    if (h->driver_pid != expect_pid || (expect_pid != 0 && h->driver_start != expect_start)) {
        unlock(w);
        return SHMW_EDRIVER;
    }
    /* Whatever is in flight now was fired by a driver that is gone: send
     * all of it again, marked.  Bounded by the in-flight count. */
    i = h->inflight_head;
    for (k = 0; k < h->inflight && k < w->capacity; k++) {
        struct shmw_entry *e;
        if (i >= w->capacity || entry_at(w, i)->state != SHMW_INFLIGHT) {
            unlock(w);
            return SHMW_ECORRUPT;
        }
        e = entry_at(w, i);
        if (!(e->flags & SHMW_REDELIVERED))
            STORE(h->redelivered, h->redelivered + 1);
        STORE(e->flags, (uint8_t)((e->flags | SHMW_REDELIVERED) & ~SHMW_SENT));
        i = e->next;
    }
    if (i != SHMW_NIL) {
        unlock(w);
        return SHMW_ECORRUPT;
    }
    STORE(h->inflight_unsent, h->inflight_head);
    STORE(h->driver_pid, pid);
    STORE(h->driver_start, pid ? start : 0);
    STORE(h->driver_state, pid ? SHMW_DRIVER_RUNNING : SHMW_DRIVER_NONE);
    STORE(h->sleep_until, 0);
    unlock(w);
    return SHMW_OK;
}

int shmw_driver_set_state(shmw_t *w, int32_t pid, uint32_t state)
{
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (state > SHMW_DRIVER_STOPPING)
        return SHMW_EINVAL;
    if ((rc = lock(w)))
        return rc;
    if (w->hdr->driver_pid != pid)
        rc = SHMW_EDRIVER;
    else
        STORE(w->hdr->driver_state, state);
    unlock(w);
    return rc;
}

int shmw_drive_clock(shmw_t *w, const volatile int *stop, uint32_t batch)
{
    /* Fires what is due in batches of at most `batch` per lock hold, so a
     * burst of a million timers does not shut producers out, then sleeps
     * until the earliest bucket is due or a producer adds an earlier one.
     * There is no periodic tick: an idle wheel sleeps in FUTEX_WAIT. */
    struct shmw_header *h;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (batch == 0)
        return SHMW_EINVAL;
    h = w->hdr;
    while (!*stop) {
        int64_t now_ns = shmw_now_ns();
        int64_t until_ns = -1;
        uint32_t fired = 0, seen;
        int more = 0;

        if ((rc = lock(w)))
            return rc;
        if (h->driver_pid != cached_pid) {
            unlock(w);
            return SHMW_EDRIVER;   /* someone took over: stop at once */
        }
        STORE(h->sleep_until, 0);
        rc = advance(w, (uint64_t)now_ns / (uint64_t)w->tick_ns, now_ns, batch, NULL, &fired, &more);
        if (fired)
            __atomic_add_fetch(&h->outbox_word, 1, __ATOMIC_SEQ_CST);
        if (rc) {
            unlock(w);
            if (fired)          /* what it moved in flight before the error is the dispatcher's */
                futex_wake_all(&h->outbox_word);
            return rc;
        }
        if (!more) {
            /* Nothing more is due: sleep until the earliest bucket, but
             * never longer than SHMW_MAX_SLEEP_NS.  The cap bounds the
             * stall if a producer dies between lowering sleep_until and
             * its FUTEX_WAKE (or under the lock): a later add for the same
             * moment skips the wake, so only the sleeper can recover. */
            until_ns = now_ns + SHMW_MAX_SLEEP_NS;
            if (h->heap_len > 0 && h->heap_len <= w->nbuckets && w->heap[0] < w->nbuckets) {
                uint64_t next = w->buckets[w->heap[0]].expires;
                STORE(h->sleep_until, next);
                if (ticks_to_ns(w, next) < until_ns)
                    until_ns = ticks_to_ns(w, next);
            } else {
                STORE(h->sleep_until, UINT64_MAX);
            }
        }
        seen = __atomic_load_n(&h->wake_word, __ATOMIC_SEQ_CST);
        unlock(w);
        if (fired)
            futex_wake_all(&h->outbox_word);
        if (!more && !*stop)
            futex_wait_until(&h->wake_word, seen, until_ns);
    }
    return SHMW_OK;
}

static int write_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t k = write(fd, buf, len);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            return SHMW_EIO;
        }
        buf += k;
        len -= (size_t)k;
    }
    return SHMW_OK;
}

int shmw_drive_take(shmw_t *w, const volatile int *stop, char *buf, uint32_t cap)
{
    /* Copies up to `cap` unsent fires out of the segment under the lock
     * and marks them sent; with none unsent, sleeps until the clock fires
     * some.  Returns how many, or 0 once *stop is set and nothing is left
     * unsent.  Like the clock, it stops with SHMW_EDRIVER as soon as the
     * registration names another process: what is unsent is the new
     * driver's to hand out, and handing it out here too would deliver it
     * twice. */
    struct shmw_header *h;
    uint32_t stride;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (cap == 0 || cap > INT32_MAX)
        return SHMW_EINVAL;
    h = w->hdr;
    stride = (uint32_t)shmw_record_size(w);
    for (;;) {
        uint32_t n = 0, seen, i;
        int stopping;

        if ((rc = lock(w)))
            return rc;
        if (h->driver_pid != cached_pid) {
            unlock(w);
            return SHMW_EDRIVER;
        }
        /* *stop is read after the word: a stop set before this load is
         * seen here, and one set after it bumps the word past `seen`, so
         * the FUTEX_WAIT below returns at once.  No stop is missed. */
        seen = __atomic_load_n(&h->outbox_word, __ATOMIC_SEQ_CST);
        stopping = __atomic_load_n(stop, __ATOMIC_SEQ_CST);
        i = h->inflight_unsent;
        while (n < cap && i != SHMW_NIL) {
            struct shmw_entry *e;
            /* An entry marked sent is one the cursor should be past: a
             * scribbled cursor, which would hand it out twice. */
            if (i >= w->capacity || (e = entry_at(w, i))->state != SHMW_INFLIGHT || !entry_sane(w, e)
                || (e->flags & SHMW_SENT)) {
                if (n > 0)
                    break;      /* hand out what was taken; the next take meets it */
                unlock(w);
                return SHMW_ECORRUPT;
            }
            write_record(w, i, buf + (uint64_t)n * stride);
            STORE(e->flags, e->flags | SHMW_SENT);
            n++;
            i = e->next;
        }
        STORE(h->inflight_unsent, i);
        unlock(w);
        if (n)
            return (int)n;
        if (stopping)
            return 0;
        futex_wait_until(&h->outbox_word, seen, -1);
    }
}

int shmw_drive_writer(shmw_t *w, int fd, const volatile int *stop, char *buf, uint32_t cap)
{
    /* Takes fires and writes them to the fd outside the lock.  A slow
     * reader blocks this thread only: the clock goes on firing into the
     * in-flight FIFO meanwhile. */
    size_t stride;
    int n;

    if (!w)
        return SHMW_ECLOSED;
    stride = (size_t)shmw_record_size(w);
    while ((n = shmw_drive_take(w, stop, buf, cap)) > 0) {
        int rc = write_all(fd, buf, (size_t)n * stride);
        if (rc)
            return rc;
    }
    return n;
}

int shmw_ack_many(shmw_t *w, const int64_t *handles, uint32_t n, uint32_t errors)
{
    uint32_t k, done = 0;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    for (k = 0; k < n; k++)
        if (handles[k] < 0)
            return SHMW_EHANDLE;
    if ((rc = lock(w)))
        return rc;
    STORE(w->hdr->handler_errors, w->hdr->handler_errors + errors);
    for (k = 0; k < n; k++) {
        uint32_t i = lookup(w, handles[k], SHMW_INFLIGHT);
        if (i == SHMW_NIL)
            continue;
        if ((rc = inflight_unlink(w, i)))
            break;
        slot_free(w, i);
        STORE(w->hdr->acked, w->hdr->acked + 1);
        done++;
    }
    unlock(w);
    return rc ? rc : (int)done;
}

/* Timers in buckets.  Not a counter of its own: every slot is free,
 * retired, in flight or pending, and the first three are counted anyway.
 * (A scribbled count gives 0 rather than a wrapped number.) */
static uint32_t pending_locked(const shmw_t *w)
{
    const struct shmw_header *h = w->hdr;
    uint64_t other = (uint64_t)h->free_count + h->retired + h->inflight;

    return other <= w->capacity ? w->capacity - (uint32_t)other : 0;
}

int shmw_pending(shmw_t *w)
{
    uint32_t n;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if ((rc = lock(w)))
        return rc;
    n = pending_locked(w);     /* <= capacity <= SHMW_MAX_CAPACITY: fits an int */
    unlock(w);
    return (int)n;
}

int shmw_stats(shmw_t *w, struct shmw_stats *out)
{
    struct shmw_header *h;
    uint32_t k;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    h = w->hdr;
    memset(out, 0, sizeof(*out));
    if ((rc = lock_raw(w)))     /* a damaged segment can still be looked at, and opened to repair */
        return rc;
    out->capacity = w->capacity;
    out->pending = pending_locked(w);
    out->free = h->free_count;
    out->retired = h->retired;
    out->added = h->added;
    out->cancelled = h->cancelled;
    out->fired = h->fired;
    out->resets = h->resets;
    out->elapsed = h->elapsed;
    out->tick_ns = w->tick_ns;
    out->payload_size = w->payload_size;
    out->wheel_size = 1ULL << w->wheel_bits;
    out->levels = w->levels;
    out->buckets_in_heap = h->heap_len;
    out->next_expiry_ns = -1;
    if (h->heap_len > 0 && h->heap_len <= w->nbuckets && w->heap[0] < w->nbuckets)
        out->next_expiry_ns = ticks_to_ns(w, w->buckets[w->heap[0]].expires);
    /* Per level, from the non-empty buckets: O(heap_len), once per call,
     * instead of a counter that every add and cancel would write. */
    for (k = 0; k < h->heap_len && k < w->nbuckets; k++) {
        uint32_t b = w->heap[k], l = b >> w->wheel_bits, m;
        if (b >= w->nbuckets || l >= w->levels)
            continue;
        for (m = w->buckets[b].lanes & ((1U << SHMW_LANES) - 1); m; m &= m - 1)  /* the lanes in use */
            out->level_pending[l] += list_of(w, (uint32_t)__builtin_ctz(m), b)->count;
    }
    out->driver_pid = h->driver_pid;
    out->driver_start = h->driver_start;
    out->driver_state = h->driver_state;
    out->inflight = h->inflight;
    out->acked = h->acked;
    out->redelivered = h->redelivered;
    out->handler_errors = h->handler_errors;
    out->advanced_ns = h->advanced_ns;
    out->clock_ns = ticks_to_ns(w, h->elapsed);
    out->recoveries = h->recoveries;
    out->repairs = h->repairs;
    out->quarantined = h->quarantined;
    out->removed = h->removed != 0;
    unlock(w);
    return SHMW_OK;
}

/* ---- producers ------------------------------------------------------------ */

int shmw_producer_attach(shmw_t *w, int32_t pid, int64_t start, uint32_t pidns)
{
    struct shmw_header *h;
    uint32_t k, slot = SHMW_NO_PRODUCER;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (pid <= 0)
        return SHMW_EINVAL;
    if ((rc = lock(w)))
        return rc;
    h = w->hdr;
    for (k = 0; k < SHMW_MAX_PRODUCERS; k++) {
        if (h->producers[k].pid == pid && h->producers[k].start == start && h->producers[k].pidns == pidns) {
            slot = k;           /* this process attached before */
            break;
        }
        if (h->producers[k].pid == 0 && slot == SHMW_NO_PRODUCER)
            slot = k;
    }
    if (slot != SHMW_NO_PRODUCER && h->producers[slot].pid != pid) {
        STORE(h->producers[slot].start, start);
        STORE(h->producers[slot].pidns, pidns);
        COMMIT(h->producers[slot].pid, pid);      /* commits the slot */
    }
    unlock(w);
    if (slot == SHMW_NO_PRODUCER)
        return SHMW_EPRODUCER;
    w->producer = slot;
    w->producer_pid = pid;
    return (int)slot;
}

int shmw_producers(shmw_t *w, int32_t *pids, int64_t *starts, uint32_t *pidns, uint32_t max)
{
    /* The whole table, slot by slot (pid 0: free); returns the slots in use. */
    uint32_t k, n = 0;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (max < SHMW_MAX_PRODUCERS)
        return SHMW_EINVAL;
    if ((rc = lock_raw(w)))     /* a look, which a damaged segment allows */
        return rc;
    for (k = 0; k < SHMW_MAX_PRODUCERS; k++) {
        pids[k] = w->hdr->producers[k].pid;
        starts[k] = w->hdr->producers[k].start;
        pidns[k] = w->hdr->producers[k].pidns;
        n += pids[k] != 0;
    }
    unlock(w);
    return (int)n;
}

static int producer_is(const shmw_t *w, uint32_t slot, int32_t pid, int64_t start)
{
    return slot < SHMW_MAX_PRODUCERS && pid > 0 && w->hdr->producers[slot].pid == pid
        && w->hdr->producers[slot].start == start;
}

int shmw_producer_reap(shmw_t *w, uint32_t slot, int32_t pid, int64_t start, uint32_t from, uint32_t count)
{
    /* O(count) under the lock: the caller sweeps the slab in ranges so
     * that no hold is long. */
    uint32_t i, end, done = 0;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if ((rc = lock(w)))
        return rc;
    if (!producer_is(w, slot, pid, start)) {
        unlock(w);
        return SHMW_EPRODUCER;
    }
    end = from < w->capacity && count < w->capacity - from ? from + count : w->capacity;
    for (i = from; i < end && rc == SHMW_OK; i++) {
        struct shmw_entry *e = entry_at(w, i);
        if (e->state != SHMW_PENDING || e->producer != slot || !(e->flags & SHMW_CANCEL_ON_EXIT))
            continue;
        if ((rc = bucket_unlink(w, i)))
            break;
        slot_free(w, i);
        STORE(w->hdr->cancelled, w->hdr->cancelled + 1);
        done++;
    }
    unlock(w);
    return rc ? rc : (int)done;
}

int shmw_producer_release(shmw_t *w, uint32_t slot, int32_t pid, int64_t start)
{
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if ((rc = lock(w)))
        return rc;
    if (producer_is(w, slot, pid, start)) {
        STORE(w->hdr->producers[slot].pid, 0);
        STORE(w->hdr->producers[slot].start, 0);
        STORE(w->hdr->producers[slot].pidns, 0);
    } else {
        rc = SHMW_EPRODUCER;
    }
    unlock(w);
    return rc;
}

/* ---- recovery -------------------------------------------------------------
 * A lock holder that dies leaves its change half-made.  What each entry
 * says about itself (state, generation, deadline, payload) is written before
 * the one store that commits it, its state, so it is authoritative; the
 * free list, the buckets and their heap and the counters are derived from
 * it and rebuilt here, in O(capacity + buckets), without allocating.  An
 * entry whose own fields make no sense (a scribble: an unknown state, a
 * generation that makes no handle, a payload longer than its slot) is
 * quarantined - retired, never handed out again - so that a repair always
 * succeeds and the healthy timers go on firing.  The in-flight FIFO is kept
 * if it still walks cleanly and its unsent cursor sits between the entries
 * handed out (SHMW_SENT) and the rest; otherwise it is rebuilt in slot
 * order, the entries handed out first and the cursor after them, so that a
 * live driver hands nothing out twice (a driver that died redelivers all of
 * it anyway, marked, when the next one registers).  Repair rewrites nothing
 * an entry says about itself but links and the state of a quarantined one,
 * so it can be repeated: a repairer that dies too leaves the next locker
 * the same job. */

static int inflight_walks(const shmw_t *w, uint32_t count)
{
    const struct shmw_header *h = w->hdr;
    uint32_t i = h->inflight_head, prev = SHMW_NIL, k;
    int past_cursor = 0;

    if (h->inflight != count)
        return 0;
    for (k = 0; k < count; k++) {
        const struct shmw_entry *e;
        if (i >= w->capacity)
            return 0;
        e = entry_at(w, i);
        if (e->state != SHMW_INFLIGHT || e->prev != prev)
            return 0;
        past_cursor |= i == h->inflight_unsent;
        if (((e->flags & SHMW_SENT) != 0) == past_cursor)
            return 0;           /* sent after the cursor, or unsent before it */
        prev = i;
        i = e->next;
    }
    return i == SHMW_NIL && h->inflight_tail == prev && (past_cursor || h->inflight_unsent == SHMW_NIL);
}

/* Retires entry i for good, whatever it was: a repair found it nonsensical. */
static void quarantine(shmw_t *w, uint32_t i)
{
    struct shmw_entry *e = entry_at(w, i);

    STORE(e->next, SHMW_NIL); STORE(e->prev, SHMW_NIL); STORE(e->bucket, SHMW_NIL);
    STORE(e->flags, 0);
    COMMIT(e->state, SHMW_RETIRED);
    STORE(w->hdr->quarantined, w->hdr->quarantined + 1);
}

#define SAY(...) do { \
        if (reason && !said) { snprintf(reason, reason_len, __VA_ARGS__); said = 1; } \
    } while (0)

/* clock_limit_ns >= 0: a wheel clock past that time is set back to it (a
 * scribbled clock would fire every timer early).  The first thing found
 * wrong goes into reason, if it is not NULL and nothing is there yet. */
static int repair_locked(shmw_t *w, int64_t clock_limit_ns, char *reason, uint32_t reason_len)
{
    struct shmw_header *h = w->hdr;
    uint32_t i, b, inflight = 0;
    uint64_t expires;
    int rc, said = reason && reason_len && reason[0];

    /* (A wheel starts at its creation time rounded up to a tick: a clock
     * up to that is not ahead.) */
    if (clock_limit_ns >= 0 && h->elapsed > shmw_ticks_ceil(clock_limit_ns, w->tick_ns)) {
        SAY("header: the wheel clock, tick %llu, is ahead of the real clock",
            (unsigned long long)h->elapsed);
        STORE(h->elapsed, shmw_ticks_ceil(clock_limit_ns, w->tick_ns));
    }

    /* What an entry says about itself must make sense on its own, and a
     * pending one must have a place on the wheel. */
    for (i = 0; i < w->capacity; i++) {
        struct shmw_entry *e = entry_at(w, i);
        switch (e->state) {
        case SHMW_FREE:
        case SHMW_RETIRED:
            continue;
        case SHMW_PENDING:
        case SHMW_INFLIGHT:
            if (entry_sane(w, e)
                && (e->state == SHMW_INFLIGHT
                    || place(w, h->elapsed, shmw_ticks_ceil(e->deadline_ns, w->tick_ns), &b, &expires) == SHMW_OK)) {
                inflight += e->state == SHMW_INFLIGHT;
                continue;
            }
            SAY("slab: entry %u in state %u makes no sense (generation %llu, payload_len %u, flags %#x)", i,
                e->state, (unsigned long long)e->generation, e->payload_len, e->flags);
            break;
        default:
            SAY("slab: entry %u has unknown state %u", i, e->state);
            break;
        }
        quarantine(w, i);
    }

    for (b = 0; b < w->nbuckets; b++) {
        STORE(w->buckets[b].lanes, 0);
        STORE(w->buckets[b].heap_pos, SHMW_NIL);
    }
    for (b = 0; b < SHMW_LANES * w->nbuckets; b++) {
        STORE(w->lists[b].head, SHMW_NIL); STORE(w->lists[b].tail, SHMW_NIL);
        STORE(w->lists[b].count, 0);
    }
    STORE(h->heap_len, 0);
    set_elapsed(w, h->elapsed, h->advanced_ns);

    if (!inflight_walks(w, inflight)) {
        STORE(h->inflight_head, SHMW_NIL); STORE(h->inflight_tail, SHMW_NIL);
        STORE(h->inflight_unsent, SHMW_NIL);
        STORE(h->inflight, 0);
    } else {
        inflight = 0;   /* kept as it is */
    }

    /* Every free slot to the shared list, highest index first, so that it
     * hands out low slots first; the magazines start empty. */
    STORE(h->free_head, SHMW_NIL);
    STORE(h->free_count, 0);
    for (b = 0; b < SHMW_LANES; b++) {
        STORE(h->lanes[b].free_head, SHMW_NIL);
        STORE(h->lanes[b].free_count, 0);
    }
    STORE(h->retired, 0);
    for (i = w->capacity; i-- > 0;) {
        struct shmw_entry *e = entry_at(w, i);
        switch (e->state) {
        case SHMW_FREE:
            if (e->generation >= w->max_generation) {
                COMMIT(e->state, SHMW_RETIRED);   /* died between alloc and commit */
                STORE(h->retired, h->retired + 1);
                break;
            }
            STORE(e->next, h->free_head);
            STORE(h->free_head, i);
            STORE(h->free_count, h->free_count + 1);
            break;
        case SHMW_RETIRED:
            STORE(h->retired, h->retired + 1);
            break;
        case SHMW_PENDING:
            if ((rc = place(w, h->elapsed, shmw_ticks_ceil(e->deadline_ns, w->tick_ns), &b, &expires)))
                return rc;      /* checked above: not reached */
            if ((rc = bucket_append(w, b, expires, i)))
                return rc;
            break;
        }
    }
    /* A broken in-flight FIFO: relink it in slot order, what was handed
     * out first, the unsent cursor on the first of the rest. */
    for (b = 0; b < 2 && inflight > 0; b++) {
        for (i = 0; i < w->capacity; i++) {
            struct shmw_entry *e = entry_at(w, i);
            if (e->state != SHMW_INFLIGHT || ((e->flags & SHMW_SENT) != 0) == b)
                continue;
            inflight_append(w, i);
            if (b == 0)
                STORE(h->inflight_unsent, SHMW_NIL);
        }
    }
    /* The registration is written in three stores; make them agree. */
    if (h->driver_pid == 0) {
        STORE(h->driver_state, SHMW_DRIVER_NONE);
        STORE(h->driver_start, 0);
    } else if (h->driver_state == SHMW_DRIVER_NONE || h->driver_state > SHMW_DRIVER_STOPPING) {
        STORE(h->driver_state, SHMW_DRIVER_RUNNING);
    }
    STORE(h->flags, h->flags & ~SHMW_F_DAMAGED);
    STORE(h->recoveries, h->recoveries + 1);
    return SHMW_OK;
}

#undef SAY

int shmw_repair(shmw_t *w, int64_t now_ns, char *reason, uint32_t reason_len)
{
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if (now_ns < 0)
        return SHMW_EINVAL;
    if (reason && reason_len)
        reason[0] = '\0';
    if ((rc = lock_raw(w)))
        return rc;
    /* The clock is read again under the lock: the driver's clock may have
     * moved the wheel past the caller's now meanwhile, which is no fault. */
    if (shmw_now_ns() > now_ns)
        now_ns = shmw_now_ns();
    if (check_locked(w, reason, reason_len) == SHMW_OK
        && w->hdr->elapsed <= shmw_ticks_ceil(now_ns, w->tick_ns)) {
        unlock(w);
        return 0;
    }
    rc = repair_locked(w, now_ns, reason, reason_len);
    if (rc == SHMW_OK) {
        /* Counted as a repair, not as a recovery from a dead holder. */
        STORE(w->hdr->recoveries, w->hdr->recoveries - 1);
        STORE(w->hdr->repairs, w->hdr->repairs + 1);
    } else {
        STORE(w->hdr->flags, w->hdr->flags | SHMW_F_DAMAGED);
    }
    /* The clock may be asleep on a bucket the repair moved, the dispatcher
     * on fires the rebuilt list put back: both look again. */
    __atomic_add_fetch(&w->hdr->wake_word, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&w->hdr->outbox_word, 1, __ATOMIC_SEQ_CST);
    unlock(w);
    futex_wake_all(&w->hdr->wake_word);
    futex_wake_all(&w->hdr->outbox_word);
    return rc ? rc : 1;
}

int shmw_is_removed(shmw_t *w)
{
    if (!w)
        return SHMW_ECLOSED;
    return __atomic_load_n(&w->hdr->removed, __ATOMIC_RELAXED) != 0;
}

int shmw_mark_removed(shmw_t *w)
{
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if ((rc = lock_raw(w)))
        return rc;
    STORE(w->hdr->removed, 1);
    unlock(w);
    return SHMW_OK;
}

/* ---- the invariant checker -----------------------------------------------------
 * O(capacity + buckets), under the lock.  It allocates nothing: each list
 * is walked for exactly as many steps as its count says and must end
 * there, which together with the per-state totals proves every entry is on
 * exactly one list. */

#define FAIL(...) do { \
        if (reason) snprintf(reason, reason_len, __VA_ARGS__); \
        return SHMW_ECORRUPT; \
    } while (0)

/* Lane `lane`'s list of non-empty bucket b: count long, doubly linked,
 * pending entries of that lane that point back at b, each due within the
 * bucket. */
static int check_list(const shmw_t *w, uint32_t b, uint32_t lane, char *reason, uint32_t reason_len)
{
    const struct shmw_bucket *bk = &w->buckets[b];
    const struct shmw_list *ls = list_of(w, lane, b);
    uint32_t level = b >> w->wheel_bits, prev = SHMW_NIL, i = ls->head, k;
    uint64_t gran = level * w->wheel_bits >= 64 ? UINT64_MAX : 1ULL << (level * w->wheel_bits);

    for (k = 0; k < ls->count; k++) {
        const struct shmw_entry *e;
        uint64_t t;
        if (i >= w->capacity)
            FAIL("bucket %u: lane %u step %u has index %u out of bounds", b, lane, k, i);
        e = entry_at(w, i);
        if (e->state != SHMW_PENDING || e->bucket != b || e->prev != prev || lane_of(e->producer) != lane)
            FAIL("bucket %u: entry %u is not linked as a pending member of lane %u", b, i, lane);
        t = shmw_ticks_ceil(e->deadline_ns, w->tick_ns);
        /* Level 0 holds its own tick, and overdue timers only in the
         * bucket at the clock; level l holds W^l ticks from its expiry. */
        if (level == 0 ? (t > bk->expires || (t < bk->expires && bk->expires != w->hdr->elapsed))
                       : (t < bk->expires || t - bk->expires >= gran))
            FAIL("bucket %u: entry %u due at tick %llu outside the bucket [%llu, +%llu)", b, i,
                 (unsigned long long)t, (unsigned long long)bk->expires, (unsigned long long)gran);
        prev = i;
        i = e->next;
    }
    if (i != SHMW_NIL || ls->tail != prev)
        FAIL("bucket %u: lane %u does not end after count %u", b, lane, ls->count);
    return SHMW_OK;
}

static int check_locked(shmw_t *w, char *reason, uint32_t reason_len)
{
    struct shmw_header *h = w->hdr;
    uint64_t free_seen = 0, pending_seen = 0, retired_seen = 0, inflight_seen = 0, in_buckets = 0, nonempty = 0;
    int unsent_found, past_cursor = 0;
    uint32_t i, b, l, k;

    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != SHMW_MAGIC)
        FAIL("header: magic overwritten");
    if (h->flags & SHMW_F_DAMAGED)
        FAIL("header: a process died holding the lock and left the segment inconsistent");
    if (h->capacity != w->capacity || h->tick_ns != w->tick_ns || h->payload_size != w->payload_size
        || h->wheel_bits != w->wheel_bits || h->levels != w->levels || h->stride != w->stride
        || h->slot_bits != w->slot_bits || (h->handle_key & w->max_generation) != w->handle_key)
        FAIL("header: parameters changed since open");
    for (l = 0; l < w->levels; l++)
        if (h->level_clock[l] != shmw_bucket_expiry(h->elapsed, l, w->wheel_bits))
            FAIL("header: level %u clock %llu does not match elapsed %llu", l,
                 (unsigned long long)h->level_clock[l], (unsigned long long)h->elapsed);

    for (i = 0; i < w->capacity; i++) {
        struct shmw_entry *e = entry_at(w, i);
        if ((e->state != SHMW_RETIRED && e->generation > w->max_generation)  /* a retired one's is unused */
            || (e->state == SHMW_FREE && e->generation == w->max_generation)
            || ((e->state == SHMW_PENDING || e->state == SHMW_INFLIGHT) && e->generation == 0))
            FAIL("slab: entry %u in state %u has generation %llu out of range", i, e->state,
                 (unsigned long long)e->generation);
        if ((e->state == SHMW_PENDING || e->state == SHMW_INFLIGHT) && !entry_sane(w, e))
            FAIL("slab: entry %u in state %u makes no sense (payload_len %u, deadline %lld, flags %#x, "
                 "producer %u)", i, e->state, e->payload_len, (long long)e->deadline_ns, e->flags, e->producer);
        if (e->state == SHMW_PENDING) {
            pending_seen++;
        } else if (e->state == SHMW_FREE) {
            free_seen++;
        } else if (e->state == SHMW_RETIRED) {
            retired_seen++;
        } else if (e->state == SHMW_INFLIGHT) {
            inflight_seen++;
        } else {
            FAIL("slab: entry %u has unknown state %u", i, e->state);
        }
    }
    if (free_seen != h->free_count)
        FAIL("counters: free_count is %u but %llu entries are free", h->free_count,
             (unsigned long long)free_seen);
    if (retired_seen != h->retired)
        FAIL("counters: retired is %u but %llu entries are retired", h->retired,
             (unsigned long long)retired_seen);
    if (inflight_seen != h->inflight)
        FAIL("counters: inflight is %u but %llu entries are in flight", h->inflight,
             (unsigned long long)inflight_seen);
    if (h->driver_state > SHMW_DRIVER_STOPPING || (h->driver_pid == 0) != (h->driver_state == SHMW_DRIVER_NONE))
        FAIL("driver: state %u does not match pid %d", h->driver_state, h->driver_pid);

    /* The in-flight FIFO: inflight steps, doubly linked, then NIL; the
     * unsent cursor is NIL or on it. */
    i = h->inflight_head;
    k = 0;
    {
        uint32_t prev = SHMW_NIL;
        unsent_found = h->inflight_unsent == SHMW_NIL;
        for (; k < h->inflight; k++) {
            struct shmw_entry *e;
            if (i >= w->capacity)
                FAIL("in-flight list: step %u has index %u out of bounds", k, i);
            e = entry_at(w, i);
            if (e->state != SHMW_INFLIGHT || e->prev != prev)
                FAIL("in-flight list: entry %u is not linked as in flight", i);
            if (i == h->inflight_unsent)
                unsent_found = past_cursor = 1;
            if (((e->flags & SHMW_SENT) != 0) == past_cursor)
                FAIL("in-flight list: entry %u is %s the unsent cursor", i,
                     past_cursor ? "marked sent after" : "not marked sent before");
            prev = i;
            i = e->next;
        }
        if (i != SHMW_NIL || h->inflight_tail != prev)
            FAIL("in-flight list: does not end after %u entries", h->inflight);
        if (!unsent_found)
            FAIL("in-flight list: the unsent cursor %u is not on it", h->inflight_unsent);
    }

    /* The free lists: the shared one and each magazine end in NIL, hold
     * only free entries, and are free_count long together.  Lists that
     * end in NIL and share an entry share their last one, so distinct
     * last entries (and the walks' total) put every free entry on exactly
     * one list. */
    {
        uint32_t last[SHMW_LANES + 1], lane, total = 0;
        for (lane = 0; lane <= SHMW_LANES; lane++) {
            uint32_t max = lane < SHMW_LANES ? h->lanes[lane].free_count : w->capacity;
            const char *name = lane < SHMW_LANES ? "magazine" : "shared free list";
            /* Before the walk: the count bounds it, and a free list has no
             * back links to stop a loop early. */
            if (lane < SHMW_LANES && max >= 2 * SHMW_MAGAZINE)
                FAIL("magazine %u: count %u, over %u", lane, max, 2 * SHMW_MAGAZINE - 1);
            i = lane < SHMW_LANES ? h->lanes[lane].free_head : h->free_head;
            last[lane] = SHMW_NIL;
            for (k = 0; k < max && i != SHMW_NIL; k++) {
                if (i >= w->capacity)
                    FAIL("%s %u: step %u has index %u out of bounds", name, lane, k, i);
                if (entry_at(w, i)->state != SHMW_FREE)
                    FAIL("%s %u: entry %u is not free", name, lane, i);
                last[lane] = i;
                i = entry_at(w, i)->next;
            }
            if (i != SHMW_NIL)
                FAIL("%s %u: longer than %u", name, lane, max);
            if (lane < SHMW_LANES && k != max)
                FAIL("magazine %u: %u long, its count says %u", lane, k, max);
            total += k;
            for (l = 0; l < lane; l++)
                if (last[lane] != SHMW_NIL && last[l] == last[lane])
                    FAIL("free lists: %u and %u share entry %u", l, lane, last[lane]);
        }
        if (total != h->free_count)
            FAIL("free lists: %u entries on them, free_count is %u", total, h->free_count);
    }

    /* Buckets: each lane's list is count long, doubly linked, holds pending
     * entries of that lane that point back at it, at the right place for
     * their expiry tick; the bucket's lane bits say which lists are not
     * empty. */
    for (b = 0; b < w->nbuckets; b++) {
        struct shmw_bucket *bk = &w->buckets[b];
        uint32_t level = b >> w->wheel_bits, lane, lanes = 0;

        for (lane = 0; lane < SHMW_LANES; lane++) {
            const struct shmw_list *ls = list_of(w, lane, b);
            if (ls->count > 0)
                lanes |= 1U << lane;
            else if (ls->head != SHMW_NIL || ls->tail != SHMW_NIL)
                FAIL("bucket %u: lane %u empty but linked", b, lane);
        }
        if (bk->lanes != lanes)
            FAIL("bucket %u: lane bits %#x, lists in use %#x", b, bk->lanes, lanes);
        if (lanes == 0) {
            if (bk->heap_pos != SHMW_NIL)
                FAIL("bucket %u: empty but in the delay-heap", b);
            continue;
        }
        nonempty++;
        if (bk->heap_pos >= h->heap_len || bk->heap_pos >= w->nbuckets || w->heap[bk->heap_pos] != b)
            FAIL("bucket %u: not at its heap position %u", b, bk->heap_pos);
        if (bk->expires < h->elapsed)
            FAIL("bucket %u: expires at tick %llu, before the clock %llu", b,
                 (unsigned long long)bk->expires, (unsigned long long)h->elapsed);
        if (shmw_slot_for(bk->expires, level, w->wheel_bits) != (b & w->wheel_mask)
            || shmw_bucket_expiry(bk->expires, level, w->wheel_bits) != bk->expires)
            FAIL("bucket %u: expiry %llu does not belong to this slot", b,
                 (unsigned long long)bk->expires);
        /* Within the level's window: what makes one slot mean one range. */
        if (shmw_level_for(shmw_bucket_expiry(h->elapsed, level, w->wheel_bits), bk->expires,
                           w->wheel_bits) > level)
            FAIL("bucket %u: expiry %llu is beyond its level's window", b,
                 (unsigned long long)bk->expires);
        for (lane = 0; lane < SHMW_LANES; lane++) {
            int rc = check_list(w, b, lane, reason, reason_len);
            if (rc)
                return rc;
            in_buckets += list_of(w, lane, b)->count;
        }
    }
    if (in_buckets != pending_seen)
        FAIL("buckets: hold %llu entries, %llu are pending", (unsigned long long)in_buckets,
             (unsigned long long)pending_seen);
    if (nonempty != h->heap_len)
        FAIL("delay-heap: %u buckets, %llu non-empty", h->heap_len, (unsigned long long)nonempty);
    /* heap_len <= nbuckets now; each heap[k] names a non-empty bucket that
     * points back at k (checked above), so the indices are in bounds. */
    for (k = 1; k < h->heap_len; k++)
        if (w->buckets[w->heap[k]].expires < w->buckets[w->heap[(k - 1) / 2]].expires)
            FAIL("delay-heap: position %u expires before its parent", k);
    return SHMW_OK;
}

int shmw_check(shmw_t *w, char *reason, uint32_t reason_len)
{
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    if ((rc = lock(w))) {
        if (reason)
            snprintf(reason, reason_len, rc == SHMW_ECORRUPT
                     ? "a process died holding the lock and left the segment inconsistent"
                     : "the lock cannot be taken");
        return rc;
    }
    rc = check_locked(w, reason, reason_len);
    unlock(w);
    return rc;
}
