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

static uint32_t shards_of(const struct shmw_params *p)
{
    return p->shards ? p->shards : 1;
}

static int check_params(const struct shmw_params *p)
{
    uint32_t shards = shards_of(p);
    uint64_t shard_capacity;

    if (shards > SHMW_MAX_SHARDS)
        return SHMW_EINVAL;
    if (p->capacity < shards || p->capacity > SHMW_MAX_CAPACITY || p->reserve >= p->capacity)
        return SHMW_EINVAL;
    shard_capacity = ((uint64_t)p->capacity + shards - 1) / shards;
    if (shard_capacity * shards > SHMW_MAX_CAPACITY || (p->reserve + shards - 1) / shards >= shard_capacity)
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

/* Offsets in a shard are from its header; the shards follow the top, one
 * after the other, each 64-byte aligned. */
struct layout {
    uint64_t buckets_off;
    uint64_t heap_off;
    uint64_t lists_off;
    uint64_t slab_off;
    uint64_t shard_size;
    uint64_t top_size;
    uint64_t users_off;
    uint64_t size;
    uint32_t stride;
    uint32_t nbuckets;
    uint32_t levels;
    uint32_t shards;
    uint32_t shard_capacity;
    uint32_t shard_reserve;
};

static void compute_layout(const struct shmw_params *p, struct layout *l)
{
    l->shards = shards_of(p);
    l->shard_capacity = (p->capacity + l->shards - 1) / l->shards;
    l->shard_reserve = (p->reserve + l->shards - 1) / l->shards;
    l->levels = shmw_levels_for(p->tick_ns, p->wheel_bits);
    l->nbuckets = l->levels << p->wheel_bits;
    l->stride = (uint32_t)ALIGN_UP(sizeof(struct shmw_entry) + p->payload_size, 8);
    l->buckets_off = ALIGN_UP(sizeof(struct shmw_header), 64);
    l->heap_off = l->buckets_off + (uint64_t)l->nbuckets * sizeof(struct shmw_bucket);
    l->lists_off = ALIGN_UP(l->heap_off + (uint64_t)l->nbuckets * sizeof(uint32_t), 64);
    l->slab_off = l->lists_off + (uint64_t)SHMW_LANES * l->nbuckets * sizeof(struct shmw_list);
    l->shard_size = ALIGN_UP(l->slab_off + (uint64_t)l->shard_capacity * l->stride, 64);
    l->top_size = ALIGN_UP(sizeof(struct shmw_top), 64);
    l->users_off = l->top_size + (uint64_t)l->shards * l->shard_size;
    l->size = l->users_off + ALIGN_UP(sizeof(struct shmw_users), 64);
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

static int init_shard(char *base, const struct shmw_params *p, const struct layout *l, uint32_t shard,
                      uint64_t handle_key, int64_t now_ns)
{
    struct shmw_header *h = (struct shmw_header *)base;
    pthread_mutexattr_t attr;
    char *slab;
    uint32_t i;
    int rc;

    /* A fresh tmpfs segment reads as zeroes; clear anyway so that init
     * over reused memory gives the same state. */
    memset(base, 0, l->slab_off);
    h->version = SHMW_LAYOUT_VERSION;
    h->header_size = sizeof(struct shmw_header);
    h->entry_size = sizeof(struct shmw_entry);
    h->bucket_size = sizeof(struct shmw_bucket);
    h->mutex_size = sizeof(pthread_mutex_t);
    h->segment_size = l->shard_size;
    h->tick_ns = p->tick_ns;
    h->capacity = l->shard_capacity;
    h->payload_size = p->payload_size;
    h->wheel_bits = p->wheel_bits;
    h->reserve = l->shard_reserve;
    h->levels = l->levels;
    h->index_bits = shmw_index_bits(l->shard_capacity * l->shards);
    h->stride = l->stride;
    h->created_ns = now_ns;
    h->creator_pid = shmw__pid;
    h->handle_key = handle_key;
    h->shard = shard;
    h->shards = l->shards;

    h->elapsed = shmw_ticks_ceil(now_ns, p->tick_ns);
    for (i = 0; i < l->levels; i++)
        h->level_clock[i] = shmw_bucket_expiry(h->elapsed, i, p->wheel_bits);

    for (i = 0; i < l->nbuckets; i++)
        ((struct shmw_bucket *)(base + l->buckets_off))[i].heap_pos = SHMW_NIL;
    for (i = 0; i < SHMW_LANES * l->nbuckets; i++) {
        struct shmw_list *ls = (struct shmw_list *)(base + l->lists_off) + i;
        ls->head = ls->tail = SHMW_NIL;
    }
    for (i = 0; i < SHMW_LANES; i++)
        h->magazines[i].free_head = SHMW_NIL;

    /* The shared free list in index order, so that a new wheel hands out
     * entries 0, 1, 2...: a lane's first magazine is entries 0 to 31. */
    slab = base + l->slab_off;
    for (i = 0; i < l->shard_capacity; i++) {
        struct shmw_entry *e = (struct shmw_entry *)(slab + (uint64_t)i * l->stride);
        memset(e, 0, sizeof(*e));
        e->generation = 0;      /* an entry's first handle has generation 1 */
        e->producer = SHMW_NO_PRODUCER;
        e->state = SHMW_FREE;
        e->next = (i + 1 < l->shard_capacity) ? i + 1 : SHMW_NIL;
        e->prev = e->bucket = SHMW_NIL;
    }
    h->free_head = 0;
    h->free_count = l->shard_capacity;
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
    h->magic = SHMW_MAGIC;
    return SHMW_OK;
}

int shmw_init(void *base, uint64_t size, const struct shmw_params *p, int64_t now_ns)
{
    struct shmw_top *top = base;
    struct layout l;
    uint64_t handle_key;
    uint32_t k;
    int rc = check_params(p);

    if (rc)
        return rc;
    compute_layout(p, &l);
    if (size < l.size)
        return SHMW_ESIZE;
    shmw__pid_init();
    /* Not secret, only different from wheel to wheel: without getrandom
     * (before Linux 3.17) the creation time and pid will do.  The system
     * call itself, not glibc's getrandom(), which only glibc 2.25 has: the
     * wheels are built for glibc 2.17 (tools/build-wheels). */
    if (syscall(SYS_getrandom, &handle_key, sizeof(handle_key), GRND_NONBLOCK) != (long)sizeof(handle_key))
        handle_key = (uint64_t)now_ns * 0x9e3779b97f4a7c15ULL ^ (uint64_t)shmw__pid;

    memset(base, 0, l.top_size);
    memset((char *)base + l.users_off, 0, sizeof(struct shmw_users));
    top->version = SHMW_LAYOUT_VERSION;
    top->top_size = sizeof(struct shmw_top);
    top->shards = l.shards;
    top->shard_capacity = l.shard_capacity;
    top->shard_size = l.shard_size;
    top->segment_size = l.size;
    for (k = 0; k < l.shards; k++)
        if ((rc = init_shard((char *)base + l.top_size + (uint64_t)k * l.shard_size, p, &l, k, handle_key, now_ns)))
            return rc;
    __atomic_store_n(&top->magic, SHMW_MAGIC, __ATOMIC_RELEASE);
    return SHMW_OK;
}

/* Shard k's view, from its header, which must agree with shard 0's (p,
 * and the key) and with its place; every parameter is copied. */
static int open_shard(shmw_t *w, uint32_t k, const struct shmw_params *p, const struct layout *l,
                      uint64_t handle_key)
{
    char *base = (char *)w->top + l->top_size + (uint64_t)k * l->shard_size;
    struct shmw_header *h = (struct shmw_header *)base;
    shard_t *s = &w->shard[k];

    if (h->magic != SHMW_MAGIC || h->version != SHMW_LAYOUT_VERSION)
        return SHMW_ECORRUPT;
    if (h->header_size != sizeof(struct shmw_header)
        || h->entry_size != sizeof(struct shmw_entry)
        || h->bucket_size != sizeof(struct shmw_bucket)
        || h->mutex_size != sizeof(pthread_mutex_t))
        return SHMW_EABI;
    if (h->capacity != l->shard_capacity || h->payload_size != p->payload_size || h->wheel_bits != p->wheel_bits
        || h->tick_ns != p->tick_ns || h->reserve != l->shard_reserve || h->levels != l->levels
        || h->stride != l->stride || h->index_bits != w->index_bits || h->segment_size != l->shard_size
        || h->shard != k || h->shards != l->shards || h->handle_key != handle_key)
        return SHMW_ECORRUPT;

    s->base = base;
    s->hdr = h;
    s->top = w->top;
    s->buckets = (struct shmw_bucket *)(base + l->buckets_off);
    s->heap = (uint32_t *)(base + l->heap_off);
    s->lists = (struct shmw_list *)(base + l->lists_off);
    s->slab = base + l->slab_off;
    s->wake_word = &w->top->wake_word;
    s->outbox_word = &w->top->outbox_word;
    s->size = l->shard_size;
    s->tick_ns = p->tick_ns;
    s->capacity = l->shard_capacity;
    s->payload_size = p->payload_size;
    s->wheel_bits = p->wheel_bits;
    s->wheel_mask = (1U << p->wheel_bits) - 1;
    s->levels = l->levels;
    s->nbuckets = l->nbuckets;
    s->index_bits = w->index_bits;
    s->stride = l->stride;
    s->reserve = l->shard_reserve;
    s->index_base = k * l->shard_capacity;
    s->shard = k;
    s->shards = l->shards;
    s->max_generation = (1ULL << (63 - s->index_bits)) - 1;
    s->handle_key = handle_key & s->max_generation;
    s->lock_timeout_ns = SHMW_LOCK_TIMEOUT_NS;
    s->producer = SHMW_NO_PRODUCER;
    s->due = 0;
    return SHMW_OK;
}

int shmw_open(void *base, uint64_t size, shmw_t **out)
{
    struct shmw_top *top = base;
    const struct shmw_header *h0;
    struct shmw_params p;
    struct layout l;
    shmw_t *w;
    uint32_t k;
    int rc;

    if (size < sizeof(uint64_t) || __atomic_load_n(&top->magic, __ATOMIC_ACQUIRE) != SHMW_MAGIC)
        return SHMW_EMAGIC;
    /* The version first (it sits right after the magic): another version
     * may have another header size. */
    if (size < offsetof(struct shmw_top, version) + sizeof(top->version))
        return SHMW_ESIZE;
    if (top->version != SHMW_LAYOUT_VERSION)
        return SHMW_EVERSION;
    if (size < sizeof(struct shmw_top))
        return SHMW_ESIZE;
    if (top->top_size != sizeof(struct shmw_top))
        return SHMW_EABI;
    if (top->shards < 1 || top->shards > SHMW_MAX_SHARDS)
        return SHMW_ECORRUPT;
    if (size < ALIGN_UP(sizeof(struct shmw_top), 64) + sizeof(struct shmw_header))
        return SHMW_ESIZE;
    /* Shard 0's parameters, the whole segment's layout from them, and
     * then every shard checked against it. */
    h0 = (const struct shmw_header *)((char *)base + ALIGN_UP(sizeof(struct shmw_top), 64));
    if (h0->header_size != sizeof(struct shmw_header))
        return SHMW_EABI;
    p.capacity = (uint32_t)((uint64_t)h0->capacity * top->shards > SHMW_MAX_CAPACITY
                            ? 0 : h0->capacity * top->shards);
    p.payload_size = h0->payload_size;
    p.wheel_bits = h0->wheel_bits;
    p.reserve = h0->reserve * top->shards;  /* below the capacity, as the shard's is below its own */
    p.tick_ns = h0->tick_ns;
    p.shards = top->shards;
    if (check_params(&p))
        return SHMW_ECORRUPT;
    compute_layout(&p, &l);
    if (l.shard_capacity != h0->capacity || l.shard_capacity != top->shard_capacity
        || l.shard_size != top->shard_size || l.size != top->segment_size)
        return SHMW_ECORRUPT;
    if (size < l.size)
        return SHMW_ESIZE;

    w = calloc(1, sizeof(*w) + (uint64_t)l.shards * sizeof(shard_t));
    if (!w)
        return SHMW_ENOMEM;
    w->top = top;
    w->users = (struct shmw_users *)((char *)base + l.users_off);
    w->size = l.size;
    w->shards = l.shards;
    w->capacity = l.shard_capacity * l.shards;
    w->shard_capacity = l.shard_capacity;
    w->payload_size = p.payload_size;
    w->index_bits = shmw_index_bits(w->capacity);
    w->index_mask = (1ULL << w->index_bits) - 1;
    shmw__divisor(&w->by_shard, l.shard_capacity);
    w->producer = SHMW_NO_PRODUCER;
    for (k = 0; k < l.shards; k++) {
        if ((rc = open_shard(w, k, &p, &l, h0->handle_key))) {
            free(w);
            return rc;
        }
    }
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
    return (int)record_stride(&w->shard[0]);
}

/* ---- removal ------------------------------------------------------------------ */

int shmw_is_removed(shmw_t *w)
{
    if (!w)
        return SHMW_ECLOSED;
    return __atomic_load_n(&w->shard[0].hdr->removed, __ATOMIC_RELAXED) != 0;
}

int shmw_mark_removed(shmw_t *w)
{
    /* Every shard's, each under its own lock: an add that takes a shard's
     * lock after its mark fails. */
    uint32_t k;
    int rc;

    if (!w)
        return SHMW_ECLOSED;
    for (k = 0; k < w->shards; k++) {
        if ((rc = shmw__lock_raw(&w->shard[k], 1)))
            return rc;
        STORE(w->shard[k].hdr->removed, 1);
        shmw__unlock(&w->shard[k]);
    }
    return SHMW_OK;
}
