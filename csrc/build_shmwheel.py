"""Build script for the cffi extension ``shmwheel._shmwheel``.

setuptools finds it through ``cffi_modules`` in setup.py.  The cdef names
every constant with ``...`` so that the compiler, not Python, supplies the
value: shmwheel.h is the only place a number is written down.
"""

from cffi import FFI

CDEF = """
#define SHMW_MAGIC ...
#define SHMW_LAYOUT_VERSION ...
#define SHMW_MIN_WHEEL_BITS ...
#define SHMW_MAX_WHEEL_BITS ...
#define SHMW_MAX_LEVELS ...
#define SHMW_MIN_TICK_NS ...
#define SHMW_MAX_TICK_NS ...
#define SHMW_MAX_CAPACITY ...
#define SHMW_MAX_PAYLOAD ...
#define SHMW_MAX_DELAY_NS ...
#define SHMW_NIL ...

#define SHMW_OK ...
#define SHMW_EINVAL ...
#define SHMW_ETIME ...
#define SHMW_ERANGE ...
#define SHMW_EPAYLOAD ...
#define SHMW_EFULL ...
#define SHMW_EHANDLE ...
#define SHMW_ECORRUPT ...
#define SHMW_EMAGIC ...
#define SHMW_EVERSION ...
#define SHMW_EABI ...
#define SHMW_ESIZE ...
#define SHMW_ELOCK ...
#define SHMW_ENOMEM ...
#define SHMW_ECLOSED ...

#define SHMW_F_DAMAGED ...

#define SHMW_FREE ...
#define SHMW_PENDING ...
#define SHMW_RETIRED ...

/* The segment's structs, for white-box tests that scribble on it. */
struct shmw_header {
    uint64_t magic;
    uint32_t version;
    uint32_t capacity;
    uint32_t payload_size;
    uint32_t levels;
    uint32_t stride;
    uint64_t elapsed;
    uint32_t free_head;
    uint32_t free_count;
    uint32_t pending;
    uint32_t heap_len;
    uint32_t flags;
    ...;
};
struct shmw_bucket {
    uint64_t expires;
    uint32_t head;
    uint32_t tail;
    uint32_t count;
    uint32_t heap_pos;
};
struct shmw_entry {
    int64_t  deadline_ns;
    uint64_t generation;
    uint32_t next;
    uint32_t prev;
    uint32_t bucket;
    uint32_t state;
    int32_t  owner_pid;
    uint32_t payload_len;
};

struct shmw_fire {
    int64_t  handle;
    int64_t  deadline_ns;
    int64_t  fired_at_ns;
    int32_t  owner_pid;
    uint32_t payload_len;
};
struct shmw_stats {
    uint64_t capacity;
    uint64_t pending;
    uint64_t free;
    uint64_t retired;
    uint64_t added;
    uint64_t cancelled;
    uint64_t fired;
    uint64_t resets;
    uint64_t elapsed;
    int64_t  tick_ns;
    uint64_t payload_size;
    uint64_t wheel_size;
    uint64_t levels;
    uint64_t buckets_in_heap;
    int64_t  next_expiry_ns;
    uint64_t level_pending[...];
};
struct shmw_params {
    uint32_t capacity;
    uint32_t payload_size;
    uint32_t wheel_bits;
    int64_t  tick_ns;
};
typedef struct shmw shmw_t;

uint64_t shmw_ticks_ceil(int64_t ns, int64_t tick_ns);
uint32_t shmw_level_for(uint64_t elapsed, uint64_t t, uint32_t wheel_bits);
uint32_t shmw_slot_for(uint64_t t, uint32_t level, uint32_t wheel_bits);
uint64_t shmw_bucket_expiry(uint64_t t, uint32_t level, uint32_t wheel_bits);
uint32_t shmw_levels_for(int64_t tick_ns, uint32_t wheel_bits);
uint32_t shmw_slot_bits(uint32_t capacity);
int      shmw_seconds_to_ns(double seconds, int64_t *out);
int64_t  shmw_now_ns(void);

int  shmw_segment_size(const struct shmw_params *p, uint64_t *size);
int  shmw_init(void *base, uint64_t size, const struct shmw_params *p, int64_t now_ns);
int  shmw_open(void *base, uint64_t size, shmw_t **out);
void shmw_close(shmw_t *w);
int  shmw_layout(shmw_t *w, uint64_t *buckets_off, uint64_t *heap_off, uint64_t *slab_off);

int64_t shmw_add(shmw_t *w, double delay_s, const char *payload, uint32_t len);
int64_t shmw_add_at(shmw_t *w, double deadline_s, const char *payload, uint32_t len);
int     shmw_add_many(shmw_t *w, const double *delays, uint32_t n,
                      const char *payloads, const uint32_t *lens, int64_t *handles);
int     shmw_cancel(shmw_t *w, int64_t handle);
int     shmw_cancel_many(shmw_t *w, const int64_t *handles, uint32_t n);
int     shmw_reset(shmw_t *w, int64_t handle, double delay_s);
int     shmw_reset_at(shmw_t *w, int64_t handle, double deadline_s);
int     shmw_poll(shmw_t *w, double now_s, int use_clock, uint32_t max,
                  struct shmw_fire *fires, char *payloads);
int     shmw_stats(shmw_t *w, struct shmw_stats *out);
int     shmw_check(shmw_t *w, char *reason, uint32_t reason_len);
int     shmw_pending(shmw_t *w);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "shmwheel._shmwheel",
    '#include "shmwheel.h"',
    sources=["csrc/shmwheel.c"],
    include_dirs=["csrc"],
    extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"],
    libraries=["m", "pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
