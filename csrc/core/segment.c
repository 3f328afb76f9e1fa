/*
 * segment.c - a segment's lifetime: the parameters create accepts, the byte
 * layout they give, formatting a segment (init), opening one another process
 * made (open: every parameter checked, then copied to private memory),
 * closing, and marking it removed.  Also this process's cached pid.
 *
 * Invariants kept: a segment is visible (its magic stored, with a release)
 * only once it is whole; open accepts only a segment whose header agrees
 * with the layout its own parameters give, and the mapping is at least that
 * long.
 */
#define _GNU_SOURCE
#include "core.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/random.h> /* GRND_NONBLOCK */

/* ---- process identity ----------------------------------------------------- */

pid_t shmw__pid;
static pthread_once_t pid_once = PTHREAD_ONCE_INIT;

static void refresh_pid(void) { shmw__pid = getpid(); }

static void pid_setup(void)
{
    refresh_pid();
    pthread_atfork(NULL, NULL, refresh_pid);
}

void shmw__pid_init(void)
{
    pthread_once(&pid_once, pid_setup);
}

/* ---- parameters and layout ------------------------------------------------ */

static int check_params(const struct shmw_params *p)
{
    if (p->capacity < 1 || p->capacity > SHMW_MAX_CAPACITY || p->reserve >= p->capacity)
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

/* ---- create, open, close ---------------------------------------------------- */

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
    h->reserve = p->reserve;
    h->levels = l.levels;
    h->index_bits = shmw_index_bits(p->capacity);
    h->stride = l.stride;
    h->created_ns = now_ns;
    shmw__pid_init();
    h->creator_pid = shmw__pid;
    /* Not secret, only different from wheel to wheel: without getrandom
     * (before Linux 3.17) the creation time and pid will do.  The system
     * call itself, not glibc's getrandom(), which only glibc 2.25 has: the
     * wheels are built for glibc 2.17 (tools/build-wheels). */
    if (syscall(SYS_getrandom, &h->handle_key, sizeof(h->handle_key), GRND_NONBLOCK) != (long)sizeof(h->handle_key))
        h->handle_key = (uint64_t)now_ns * 0x9e3779b97f4a7c15ULL ^ (uint64_t)shmw__pid;

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
        h->magazines[i].free_head = SHMW_NIL;

    /* The shared free list in index order, so that a new wheel hands out
     * entries 0, 1, 2...: a lane's first magazine is entries 0 to 31. */
    slab = (char *)base + l.slab_off;
    for (i = 0; i < p->capacity; i++) {
        struct shmw_entry *e = (struct shmw_entry *)(slab + (uint64_t)i * l.stride);
        memset(e, 0, sizeof(*e));
        e->generation = 0;      /* an entry's first handle has generation 1 */
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
    p.reserve = h->reserve;
    p.tick_ns = h->tick_ns;
    if (check_params(&p))
        return SHMW_ECORRUPT;
    compute_layout(&p, &l);
    if (h->levels != l.levels || h->stride != l.stride
        || h->index_bits != shmw_index_bits(p.capacity) || h->segment_size != l.size)
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
    w->index_bits = shmw_index_bits(p.capacity);
    w->stride = l.stride;
    w->reserve = p.reserve;
    w->max_generation = (1ULL << (63 - w->index_bits)) - 1;
    w->handle_key = h->handle_key & w->max_generation;
    w->lock_timeout_ns = SHMW_LOCK_TIMEOUT_NS;
    w->producer = SHMW_NO_PRODUCER;
    shmw__pid_init();
    *out = w;
    return SHMW_OK;
}

void shmw_close(shmw_t *w)
{
    free(w);
}

int shmw_record_size(shmw_t *w)
{
    if (!w)
        return SHMW_ECLOSED;
    return (int)record_stride(w);
}

/* ---- removal ------------------------------------------------------------------ */

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
    if ((rc = shmw__lock_raw(w, 1)))
        return rc;
    STORE(w->hdr->removed, 1);
    shmw__unlock(w);
    return SHMW_OK;
}
