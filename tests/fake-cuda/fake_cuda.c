/* Ferry's FAKE CUDA driver, for tests only: exports the libcuda.so.1 entry points Ferry calls,
 * backed by host memory. Built by the test suite (ferry_tests::fake_cuda), never installed, and
 * never what a release build loads: it is reached only through FERRY_LIBCUDA or an explicit path.
 *
 * Device pointers are host pointers with bit 62 set: a non-canonical address on x86-64 and
 * aarch64, so code that dereferences device memory as host memory faults at once instead of
 * passing by luck. Copies check the tag, and that a context is current on the calling thread.
 *
 * Failures a test can switch on, by ferry_fake_cuda_fail("<entry point>", after) or by the
 * environment at cuInit (FERRY_FAKE_CUDA_FAIL=<entry point>:<after>): every call of that entry
 * point after `after` successful ones fails with CUDA_ERROR_UNKNOWN (999) until reset.
 * FERRY_FAKE_CUDA_DEVICES sets the device count (default 1).
 *
 * Copies on a stream (cuMemcpy*Async_v2) can be slowed and observed, for the tests of staging's
 * pipeline: ferry_fake_cuda_copy_delay_us(us) (or FERRY_FAKE_CUDA_COPY_DELAY_US at cuInit) makes
 * each one sleep that long before it copies; ferry_fake_cuda_max_copies_in_flight() is the most
 * that ran at once (on different threads) since reset; ferry_fake_cuda_hold_copy(n) makes the
 * n-th one from now (0: the next) wait, before it copies, until ferry_fake_cuda_release(), and
 * ferry_fake_cuda_held() says whether one waits now. Reset switches the delay and the hold off
 * (releasing a held copy) and restarts the maximum from the copies running then.
 * FERRY_FAKE_CUDA_COPY_GBPS=<rate> (read at cuInit, for benches) makes each copy on a stream last
 * at least n / rate, like a copy engine of that rate (the memcpy itself still costs CPU).
 * Built with -DFAKE_NO_DMABUF it lacks
 * cuMemGetHandleForAddressRange and reports no dma-buf support. Built with -DFAKE_HOST_POINTERS its
 * device pointers are untagged, page-aligned host memory (see below).
 *
 * The dma-buf export hands out an fd of /dev/null: not a dma-buf, so ibv_reg_dmabuf_mr on it is
 * refused by any NIC (rdma_rxe refuses dma-buf MRs before it looks at the fd).
 *
 * CUDA IPC (cuIpcGetMemHandle, cuIpcOpenMemHandle_v2, cuIpcCloseMemHandle) works between
 * processes for real: device memory is a memfd mapped shared from the start, so exporting an
 * allocation (only its base, as the driver wants) never moves it (a NIC's registration of it, as
 * on the peermem route, stays on the pages the process sees). Where no memfd can be made (the
 * descriptor limit) the allocation is anonymous memory that cuIpcGetMemHandle refuses to export
 * (CUDA_ERROR_OUT_OF_MEMORY), never moves.
 * The 64-byte handle names the exporter's pid, that memfd's fd number, the allocation's size and
 * a serial that is also the memfd's name; opening it takes that memfd with pidfd_getfd (so the
 * opener needs the right to trace the exporter, as for the driver's descriptor-based handles)
 * and maps it after checking the name and size, so a forged or stale handle is CUDA_ERROR_INVALID_HANDLE (400), never a mapping
 * of something else. Like the real driver it refuses a handle of the calling process
 * (CUDA_ERROR_INVALID_CONTEXT) unless ferry_fake_cuda_ipc_same_process(1) allows it (tests of
 * two ends in one process); opening a handle twice in a process counts a reference and returns
 * the same pointer; ferry_fake_cuda_live_ipc_imports() counts opened handles not closed.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

#ifdef FAKE_HOST_POINTERS
/* Device pointers are plain host pointers (page-aligned): a NIC's ibv_reg_mr on them succeeds
 * the way nvidia_peermem makes it succeed on a GPU's addresses. For the soft-RoCE tests of the
 * peermem route only; everything else uses the tagged pointers below. */
#define TAG 0ULL
#define IS_DEV(p) ((p) != 0)
#define IS_HOST(p) 1
#else
#define TAG (1ULL << 62)
#define IS_DEV(p) (((p) & TAG) != 0)
#define IS_HOST(p) ((((uintptr_t)(p)) & TAG) == 0)
#endif
#define ERR_INVALID_VALUE 1
#define ERR_OUT_OF_MEMORY 2
#define ERR_NOT_INITIALIZED 3
#define ERR_NO_DEVICE 100
#define ERR_INVALID_DEVICE 101
#define ERR_INVALID_CONTEXT 201
#define ERR_INVALID_HANDLE 400
#define ERR_UNKNOWN 999

int ferry_fake_cuda = 1;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialised;
static int devices = 1;
static char fail_call[64];
static long fail_after = -1;
static long fail_seen;
static long live_device, live_host, retained, copies, live_streams, live_imports;
static int ipc_same_process;
/* Copies on a stream: their delay, how many run now and the most at once, how many began, the
 * ordinal of the one to hold (-1: none) and whether it waits now. */
static long copy_delay_us, in_flight, max_in_flight, async_begun;
/* FERRY_FAKE_CUDA_COPY_GBPS (read at cuInit; benches only): a copy on a stream lasts at least
 * n / rate, as if a copy engine of that rate moved it (the memcpy still costs CPU time). */
static double copy_gbps;
static long hold_at = -1;
static int holding;
static pthread_cond_t released = PTHREAD_COND_INITIALIZER;
static __thread int current = -1;
static int contexts[64];

static void load_env(void) {
    const char *d = getenv("FERRY_FAKE_CUDA_DEVICES");
    if (d) devices = atoi(d);
    if (devices < 0) devices = 0;
    if (devices > 64) devices = 64;
    const char *f = getenv("FERRY_FAKE_CUDA_FAIL");
    if (f) {
        const char *colon = strchr(f, ':');
        size_t n = colon ? (size_t)(colon - f) : strlen(f);
        if (n >= sizeof fail_call) n = sizeof fail_call - 1;
        memcpy(fail_call, f, n);
        fail_call[n] = 0;
        fail_after = colon ? atol(colon + 1) : 0;
        fail_seen = 0;
    }
    const char *rate = getenv("FERRY_FAKE_CUDA_COPY_GBPS");
    if (rate) copy_gbps = atof(rate) > 0 ? atof(rate) : 0;
    const char *delay = getenv("FERRY_FAKE_CUDA_COPY_DELAY_US");
    if (delay) {
        pthread_mutex_lock(&lock);
        copy_delay_us = atol(delay) > 0 ? atol(delay) : 0;
        pthread_mutex_unlock(&lock);
    }
}

/* Whether this call of `name` must fail. */
static int failing(const char *name) {
    int fail = 0;
    pthread_mutex_lock(&lock);
    if (fail_after >= 0 && strcmp(name, fail_call) == 0) {
        if (fail_seen >= fail_after) fail = 1; else fail_seen++;
    }
    pthread_mutex_unlock(&lock);
    return fail;
}

static void count(long *c, long d) {
    pthread_mutex_lock(&lock);
    *c += d;
    pthread_mutex_unlock(&lock);
}

void ferry_fake_cuda_fail(const char *name, long after) {
    pthread_mutex_lock(&lock);
    snprintf(fail_call, sizeof fail_call, "%s", name);
    fail_after = after;
    fail_seen = 0;
    pthread_mutex_unlock(&lock);
}

void ferry_fake_cuda_reset(void) {
    pthread_mutex_lock(&lock);
    fail_after = -1;
    fail_call[0] = 0;
    copy_delay_us = 0;
    max_in_flight = in_flight;
    hold_at = -1;
    holding = 0;
    pthread_cond_broadcast(&released);
    pthread_mutex_unlock(&lock);
}

void ferry_fake_cuda_copy_delay_us(long us) {
    pthread_mutex_lock(&lock);
    copy_delay_us = us > 0 ? us : 0;
    pthread_mutex_unlock(&lock);
}

void ferry_fake_cuda_hold_copy(long nth) {
    pthread_mutex_lock(&lock);
    hold_at = async_begun + (nth > 0 ? nth : 0);
    pthread_mutex_unlock(&lock);
}

void ferry_fake_cuda_release(void) {
    pthread_mutex_lock(&lock);
    hold_at = -1;
    holding = 0;
    pthread_cond_broadcast(&released);
    pthread_mutex_unlock(&lock);
}

static long locked_read(const long *c) {
    pthread_mutex_lock(&lock);
    long v = *c;
    pthread_mutex_unlock(&lock);
    return v;
}

long ferry_fake_cuda_max_copies_in_flight(void) { return locked_read(&max_in_flight); }
long ferry_fake_cuda_held(void) {
    pthread_mutex_lock(&lock);
    long v = holding;
    pthread_mutex_unlock(&lock);
    return v;
}

long ferry_fake_cuda_live_device_allocs(void) { return live_device; }
long ferry_fake_cuda_live_host_allocs(void) { return live_host; }
long ferry_fake_cuda_retained_contexts(void) { return retained; }
long ferry_fake_cuda_copies(void) { return copies; }
long ferry_fake_cuda_live_streams(void) { return live_streams; }
long ferry_fake_cuda_live_ipc_imports(void) { return locked_read(&live_imports); }

/* Whether cuIpcOpenMemHandle_v2 opens a handle this very process exported (the real driver
 * refuses it; tests of two ends in one process allow it). Not cleared by reset. */
void ferry_fake_cuda_ipc_same_process(long allow) {
    pthread_mutex_lock(&lock);
    ipc_same_process = allow != 0;
    pthread_mutex_unlock(&lock);
}

/* Sets the device count (as FERRY_FAKE_CUDA_DEVICES does at cuInit) for drivers opened from now. */
void ferry_fake_cuda_set_devices(int n) {
    pthread_mutex_lock(&lock);
    devices = n < 0 ? 0 : n > 64 ? 64 : n;
    pthread_mutex_unlock(&lock);
}

CUresult cuInit(unsigned flags) {
    if (flags != 0) return ERR_INVALID_VALUE;
    if (failing("cuInit")) return ERR_UNKNOWN;
    pthread_mutex_lock(&lock);
    if (!initialised) { initialised = 1; pthread_mutex_unlock(&lock); load_env(); return 0; }
    pthread_mutex_unlock(&lock);
    return 0;
}

CUresult cuDriverGetVersion(int *v) { if (!v) return ERR_INVALID_VALUE; *v = 12040; return 0; }

CUresult cuDeviceGetCount(int *n) {
    if (!initialised) return ERR_NOT_INITIALIZED;
    *n = devices;
    return 0;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (!initialised) return ERR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= devices) return ERR_INVALID_DEVICE;
    *d = ordinal;
    return 0;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    if (d < 0 || d >= devices) return ERR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "Ferry Fake GPU %d", d);
    return 0;
}

CUresult cuDeviceGetPCIBusId(char *id, int len, CUdevice d) {
    if (d < 0 || d >= devices) return ERR_INVALID_DEVICE;
    snprintf(id, (size_t)len, "0000:%02X:00.0", 0x17 + d);
    return 0;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    if (d < 0 || d >= devices) return ERR_INVALID_DEVICE;
    *bytes = (size_t)80 << 30;
    return 0;
}

CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    if (d < 0 || d >= devices) return ERR_INVALID_DEVICE;
#ifdef FAKE_NO_DMABUF
    *v = 0;
#else
    *v = attr == 124 ? 1 : 0;
#endif
    return 0;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
    if (d < 0 || d >= devices) return ERR_INVALID_DEVICE;
    if (failing("cuDevicePrimaryCtxRetain")) return ERR_UNKNOWN;
    *ctx = &contexts[d];
    count(&retained, 1);
    return 0;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    if (d < 0 || d >= devices) return ERR_INVALID_DEVICE;
    count(&retained, -1);
    return 0;
}

CUresult cuCtxSetCurrent(void *ctx) {
    if (!ctx) { current = -1; return 0; }
    int *c = ctx;
    if (c < contexts || c >= contexts + 64) return ERR_INVALID_CONTEXT;
    current = (int)(c - contexts);
    return 0;
}

/* Live device allocations, for cuPointerGetAttribute and IPC (a fixed table: the tests make
 * few). `mapped` is the mapping's length (whole pages); `memfd` is the memfd behind an
 * allocation (-1 until exported); `imported` counts the opens of an IPC handle mapped here. */
#define MAX_ALLOCS 4096
static struct {
    CUdeviceptr start;
    size_t size, mapped;
    int dev, memfd;
    unsigned long long serial;
    long imported;
} allocs[MAX_ALLOCS];
static unsigned long long next_serial = 1;

static size_t page_round(size_t n) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (n + page - 1) / page * page;
}

/* The free slot for a new allocation, under the lock; -1 when the table is full. */
static int free_slot(void) {
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].start == 0) return i;
    return -1;
}

/* The slot of the allocation starting at p, under the lock; -1 if none. */
static int slot_of(CUdeviceptr p) {
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].start && allocs[i].start == p) return i;
    return -1;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    if (current < 0) return ERR_INVALID_CONTEXT;
    if (failing("cuMemAlloc_v2")) return ERR_OUT_OF_MEMORY;
    size_t size = n ? n : 1, mapped = page_round(size);
    /* A memfd from the start (see the header): exporting it later never moves the memory. */
    pthread_mutex_lock(&lock);
    unsigned long long serial = next_serial++ ^ ((unsigned long long)getpid() << 32);
    pthread_mutex_unlock(&lock);
    char name[64];
    snprintf(name, sizeof name, "ferry-fake-cuda-ipc-%llx", serial);
    int fd = memfd_create(name, MFD_CLOEXEC);
    void *h = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, (off_t)mapped) == 0)
        h = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED && fd >= 0) { close(fd); fd = -1; }
    if (fd < 0) h = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (h == MAP_FAILED) return ERR_OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    int i = free_slot();
    if (i < 0) {
        pthread_mutex_unlock(&lock);
        munmap(h, mapped);
        if (fd >= 0) close(fd);
        return ERR_OUT_OF_MEMORY;
    }
    *p = (CUdeviceptr)(uintptr_t)h | TAG;
    allocs[i].start = *p;
    allocs[i].size = size;
    allocs[i].mapped = mapped;
    allocs[i].dev = current;
    allocs[i].memfd = fd;
    allocs[i].serial = fd >= 0 ? serial : 0;
    allocs[i].imported = 0;
    live_device++;
    pthread_mutex_unlock(&lock);
    return 0;
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    if (!IS_DEV(p)) return ERR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    int i = slot_of(p);
    if (i < 0 || allocs[i].imported) {
        /* Not an allocation of cuMemAlloc (an opened IPC handle is closed, never freed). */
        pthread_mutex_unlock(&lock);
        return ERR_INVALID_VALUE;
    }
    size_t mapped = allocs[i].mapped;
    int memfd = allocs[i].memfd;
    allocs[i].start = 0;
    live_device--;
    pthread_mutex_unlock(&lock);
    munmap((void *)(uintptr_t)(p & ~TAG), mapped);
    if (memfd >= 0) close(memfd);
    return 0;
}

/* Memory type (2: device), device ordinal (9), range start (11) and size (12) of a pointer into
 * a live cuMemAlloc allocation; any other pointer is CUDA_ERROR_INVALID_VALUE, as the driver
 * answers for memory it does not know. */
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    if (!data) return ERR_INVALID_VALUE;
    if (failing("cuPointerGetAttribute")) return ERR_UNKNOWN;
    int found = -1;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].start && p >= allocs[i].start && p < allocs[i].start + allocs[i].size) {
            found = i;
            break;
        }
    }
    CUdeviceptr start = found >= 0 ? allocs[found].start : 0;
    size_t size = found >= 0 ? allocs[found].size : 0;
    int dev = found >= 0 ? allocs[found].dev : -1;
    pthread_mutex_unlock(&lock);
    if (found < 0) return ERR_INVALID_VALUE;
    switch (attr) {
    case 2: *(unsigned *)data = 2; return 0;
    case 9: *(int *)data = dev; return 0;
    case 11: *(CUdeviceptr *)data = start; return 0;
    case 12: *(size_t *)data = size; return 0;
    default: return ERR_INVALID_VALUE;
    }
}

CUresult cuMemAllocHost_v2(void **p, size_t n) {
    if (current < 0) return ERR_INVALID_CONTEXT;
    if (failing("cuMemAllocHost_v2")) return ERR_OUT_OF_MEMORY;
    void *h = NULL;
    if (posix_memalign(&h, 4096, n ? n : 1) != 0) return ERR_OUT_OF_MEMORY;
    memset(h, 0, n);
    *p = h;
    count(&live_host, 1);
    return 0;
}

CUresult cuMemFreeHost(void *p) {
    free(p);
    count(&live_host, -1);
    return 0;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    if (current < 0) return ERR_INVALID_CONTEXT;
    if (!IS_DEV(dst) || !IS_HOST(src)) return ERR_INVALID_VALUE;
    if (failing("cuMemcpyHtoD_v2")) return ERR_UNKNOWN;
    memcpy((void *)(uintptr_t)(dst & ~TAG), src, n);
    count(&copies, 1);
    return 0;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    if (current < 0) return ERR_INVALID_CONTEXT;
    if (!IS_DEV(src) || !IS_HOST(dst)) return ERR_INVALID_VALUE;
    if (failing("cuMemcpyDtoH_v2")) return ERR_UNKNOWN;
    memcpy(dst, (const void *)(uintptr_t)(src & ~TAG), n);
    count(&copies, 1);
    return 0;
}

/* Streams: a stream is a small allocation naming its context. Copies on a stream run at once
 * (the fake has no engine to run them later), so cuStreamSynchronize only checks the handle and
 * its context; a failure switched on for it still reaches the caller after the copy. */
struct fake_stream { int ctx; int magic; };
#define STREAM_MAGIC 0x5f5e

static int stream_ok(void *s) {
    struct fake_stream *st = s;
    return st && st->magic == STREAM_MAGIC && st->ctx == current;
}

CUresult cuStreamCreate(void **s, unsigned flags) {
    if (current < 0) return ERR_INVALID_CONTEXT;
    if (flags > 1) return ERR_INVALID_VALUE;
    if (failing("cuStreamCreate")) return ERR_UNKNOWN;
    struct fake_stream *st = malloc(sizeof *st);
    if (!st) return ERR_OUT_OF_MEMORY;
    st->ctx = current;
    st->magic = STREAM_MAGIC;
    *s = st;
    count(&live_streams, 1);
    return 0;
}

CUresult cuStreamDestroy_v2(void *s) {
    if (!stream_ok(s)) return ERR_INVALID_VALUE;
    ((struct fake_stream *)s)->magic = 0;
    free(s);
    count(&live_streams, -1);
    return 0;
}

CUresult cuStreamSynchronize(void *s) {
    if (!stream_ok(s)) return ERR_INVALID_VALUE;
    if (failing("cuStreamSynchronize")) return ERR_UNKNOWN;
    return 0;
}

/* A copy on a stream begins: counted in flight, held if it is the one to hold, then delayed. */
static void async_begin(void) {
    pthread_mutex_lock(&lock);
    long nth = async_begun++;
    in_flight++;
    if (in_flight > max_in_flight) max_in_flight = in_flight;
    if (hold_at >= 0 && nth == hold_at) {
        holding = 1;
        while (holding) pthread_cond_wait(&released, &lock);
    }
    long delay = copy_delay_us;
    pthread_mutex_unlock(&lock);
    if (delay > 0) usleep((useconds_t)delay);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Sleeps what is left of n / FERRY_FAKE_CUDA_COPY_GBPS since `t0`. */
static void copy_engine_time(size_t n, double t0) {
    if (copy_gbps <= 0) return;
    double left = (double)n / (copy_gbps * 1e9) - (now_s() - t0);
    if (left > 0) usleep((useconds_t)(left * 1e6));
}

static void async_end(void) {
    pthread_mutex_lock(&lock);
    in_flight--;
    copies++;
    pthread_mutex_unlock(&lock);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) {
    if (current < 0) return ERR_INVALID_CONTEXT;
    if (!stream_ok(s) || !IS_DEV(dst) || !IS_HOST(src)) return ERR_INVALID_VALUE;
    if (failing("cuMemcpyHtoDAsync_v2")) return ERR_UNKNOWN;
    async_begin();
    double t0 = now_s();
    memcpy((void *)(uintptr_t)(dst & ~TAG), src, n);
    copy_engine_time(n, t0);
    async_end();
    return 0;
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *s) {
    if (current < 0) return ERR_INVALID_CONTEXT;
    if (!stream_ok(s) || !IS_DEV(src) || !IS_HOST(dst)) return ERR_INVALID_VALUE;
    if (failing("cuMemcpyDtoHAsync_v2")) return ERR_UNKNOWN;
    async_begin();
    double t0 = now_s();
    memcpy(dst, (const void *)(uintptr_t)(src & ~TAG), n);
    copy_engine_time(n, t0);
    async_end();
    return 0;
}

#ifndef FAKE_NO_DMABUF
CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t n, int type,
                                       unsigned long long flags) {
    (void)n; (void)flags;
    if (!IS_DEV(p) || type != 1) return ERR_INVALID_VALUE;
    if (failing("cuMemGetHandleForAddressRange")) return ERR_UNKNOWN;
    int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ERR_UNKNOWN;
    *(int *)handle = fd;
    return 0;
}
#endif

/* The handle's layout (64 bytes, CUipcMemHandle): "FERRYIPC", the exporter's pid, its memfd's fd
 * number, the allocation's size, its serial (the memfd is named after it), the device. */
typedef struct { char reserved[64]; } CUipcMemHandle;
struct fake_handle {
    char magic[8];
    int pid, fd;
    unsigned long long size, serial;
    int dev;
};
static const char MAGIC[8] = {'F', 'E', 'R', 'R', 'Y', 'I', 'P', 'C'};

CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr p) {
    if (!handle || !IS_DEV(p)) return ERR_INVALID_VALUE;
    if (current < 0) return ERR_INVALID_CONTEXT;
    if (failing("cuIpcGetMemHandle")) return ERR_UNKNOWN;
    pthread_mutex_lock(&lock);
    int i = slot_of(p);
    /* Only the base of an allocation made here (the driver's rule too). */
    if (i < 0 || allocs[i].imported) { pthread_mutex_unlock(&lock); return ERR_INVALID_VALUE; }
    /* Anonymous memory (no memfd could be made at allocation): not exportable, never moved. */
    if (allocs[i].memfd < 0) { pthread_mutex_unlock(&lock); return ERR_OUT_OF_MEMORY; }
    struct fake_handle h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, MAGIC, sizeof MAGIC);
    h.pid = (int)getpid();
    h.fd = allocs[i].memfd;
    h.size = allocs[i].size;
    h.serial = allocs[i].serial;
    h.dev = allocs[i].dev;
    pthread_mutex_unlock(&lock);
    memset(handle, 0, sizeof *handle);
    memcpy(handle->reserved, &h, sizeof h);
    return 0;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle handle, unsigned flags) {
    if (!p || flags != 1) return ERR_INVALID_VALUE;
    if (current < 0) return ERR_INVALID_CONTEXT;
    if (failing("cuIpcOpenMemHandle_v2")) return ERR_UNKNOWN;
    struct fake_handle h;
    memcpy(&h, handle.reserved, sizeof h);
    if (memcmp(h.magic, MAGIC, sizeof MAGIC) != 0 || h.size == 0) return ERR_INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    int same = ipc_same_process;
    /* Opened before in this process: one more reference, the same pointer. */
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].start && allocs[i].imported && allocs[i].serial == h.serial) {
            allocs[i].imported++;
            live_imports++;
            *p = allocs[i].start;
            pthread_mutex_unlock(&lock);
            return 0;
        }
    }
    pthread_mutex_unlock(&lock);
    if (h.pid == (int)getpid() && !same) return ERR_INVALID_CONTEXT;
    /* The exporter's memfd, taken with pidfd_getfd: the kernel checks that this thread may
     * trace the exporter (ptrace attach, real credentials), as for a descriptor-based handle. */
    int pidfd = (int)syscall(SYS_pidfd_open, h.pid, 0);
    if (pidfd < 0) return ERR_INVALID_HANDLE;
    int fd = (int)syscall(SYS_pidfd_getfd, pidfd, h.fd, 0);
    close(pidfd);
    if (fd < 0) return ERR_INVALID_HANDLE;
    char path[64], link[128], want[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n < 0) { close(fd); return ERR_INVALID_HANDLE; }
    link[n] = 0;
    snprintf(want, sizeof want, "/memfd:ferry-fake-cuda-ipc-%llx ", h.serial);
    if (strncmp(link, want, strlen(want)) != 0) { close(fd); return ERR_INVALID_HANDLE; }
    struct stat st;
    size_t mapped = page_round((size_t)h.size);
    if (fstat(fd, &st) != 0 || (size_t)st.st_size != mapped) { close(fd); return ERR_INVALID_HANDLE; }
    void *at = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (at == MAP_FAILED) return ERR_UNKNOWN;
    pthread_mutex_lock(&lock);
    int i = free_slot();
    if (i < 0) { pthread_mutex_unlock(&lock); munmap(at, mapped); return ERR_OUT_OF_MEMORY; }
    allocs[i].start = (CUdeviceptr)(uintptr_t)at | TAG;
    allocs[i].size = (size_t)h.size;
    allocs[i].mapped = mapped;
    allocs[i].dev = current;
    allocs[i].memfd = -1;
    allocs[i].serial = h.serial;
    allocs[i].imported = 1;
    live_imports++;
    *p = allocs[i].start;
    pthread_mutex_unlock(&lock);
    return 0;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    if (!IS_DEV(p)) return ERR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    int i = slot_of(p);
    if (i < 0 || !allocs[i].imported) { pthread_mutex_unlock(&lock); return ERR_INVALID_VALUE; }
    live_imports--;
    if (--allocs[i].imported > 0) { pthread_mutex_unlock(&lock); return 0; }
    size_t mapped = allocs[i].mapped;
    allocs[i].start = 0;
    pthread_mutex_unlock(&lock);
    munmap((void *)(uintptr_t)(p & ~TAG), mapped);
    return 0;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    if (failing("cuMemGetAddressRange_v2")) return ERR_UNKNOWN;
    pthread_mutex_lock(&lock);
    int found = -1;
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].start && p >= allocs[i].start && p < allocs[i].start + allocs[i].size) {
            found = i;
            break;
        }
    }
    if (found >= 0) {
        if (base) *base = allocs[found].start;
        if (size) *size = allocs[found].size;
    }
    pthread_mutex_unlock(&lock);
    return found >= 0 ? 0 : ERR_INVALID_VALUE;
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *s) {
    if (current < 0) return ERR_INVALID_CONTEXT;
    if (!stream_ok(s) || !IS_DEV(dst) || !IS_DEV(src)) return ERR_INVALID_VALUE;
    if (failing("cuMemcpyDtoDAsync_v2")) return ERR_UNKNOWN;
    async_begin();
    double t0 = now_s();
    memmove((void *)(uintptr_t)(dst & ~TAG), (const void *)(uintptr_t)(src & ~TAG), n);
    copy_engine_time(n, t0);
    async_end();
    return 0;
}

CUresult cuGetErrorName(CUresult e, const char **s) {
    switch (e) {
    case 0: *s = "CUDA_SUCCESS"; return 0;
    case ERR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return 0;
    case ERR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return 0;
    case ERR_NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; return 0;
    case ERR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; return 0;
    case ERR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; return 0;
    case ERR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; return 0;
    case ERR_UNKNOWN: *s = "CUDA_ERROR_UNKNOWN"; return 0;
    default: return ERR_INVALID_VALUE;
    }
}
