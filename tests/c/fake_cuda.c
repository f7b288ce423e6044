/* A stand-in for the CUDA driver (libcuda.so.1) or runtime (libcudart.so),
 * for tests on machines without a GPU: built with -DFAKE_DRIVER or
 * -DFAKE_RUNTIME into a directory put on LD_LIBRARY_PATH. It does what the
 * real library's contract requires of its caller and fails the way the real
 * one does when that contract is broken:
 *   - nothing works before cuInit (CUDA_ERROR_NOT_INITIALIZED = 3);
 *   - cuMemHostRegister / cuMemHostUnregister / cuMemAlloc / cuMemcpyHtoD
 *     need a current context (CUDA_ERROR_INVALID_CONTEXT = 201);
 *   - unregistering a pointer that is not registered is
 *     CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED (713); registering an overlapping
 *     range is CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED (712);
 *   - FAKE_CUDA_FAIL_REGISTER=1 makes registration fail with
 *     CUDA_ERROR_OUT_OF_MEMORY (2).
 * Every call is appended to $FAKE_CUDA_LOG; at exit the library appends
 * "exit registered=N retained=N allocated=N" (what was never undone).
 * "Device memory" is host memory, so copies can be checked. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static FILE *logf_;
static int registered, allocated, retained;
#ifdef FAKE_DRIVER
static int initialized;
/* The context stack is per thread, as in the real driver: a thread that
 * did not push the context has none current, whatever other threads do.
 * (A process-wide counter also raced: two threads pushing and popping at
 * once could lose an update and fail a third call with 201.) */
static __thread int current;
#endif
static struct { uintptr_t p; size_t n; } regs[16];

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
    if (!logf_) {
        const char *path = getenv("FAKE_CUDA_LOG");
        if (!path) return;
        logf_ = fopen(path, "a");
        if (!logf_) return;
    }
    va_list ap;
    va_start(ap, fmt);
    vfprintf(logf_, fmt, ap);
    va_end(ap);
    fputc('\n', logf_);
    fflush(logf_);
}

__attribute__((destructor)) static void report(void) {
    say("exit registered=%d retained=%d allocated=%d", registered, retained, allocated);
}

static int do_register(void *p, size_t n, unsigned flags) {
    say("register %p %zu %u", p, n, flags);
    if (getenv("FAKE_CUDA_FAIL_REGISTER")) return 2;
    for (int i = 0; i < 16; i++)
        if (regs[i].n && (uintptr_t)p < regs[i].p + regs[i].n && regs[i].p < (uintptr_t)p + n)
            return 712;
    for (int i = 0; i < 16; i++)
        if (!regs[i].n) {
            regs[i].p = (uintptr_t)p;
            regs[i].n = n;
            registered++;
            return 0;
        }
    return 2;
}

static int do_unregister(void *p) {
    say("unregister %p", p);
    for (int i = 0; i < 16; i++)
        if (regs[i].n && regs[i].p == (uintptr_t)p) {
            regs[i].n = 0;
            registered--;
            return 0;
        }
    return 713;
}

#ifdef FAKE_DRIVER
typedef int CUresult;
static int ctx_token;
#define NEED_INIT if (!initialized) return 3
#define NEED_CTX NEED_INIT; if (!current) return 201

CUresult cuInit(unsigned flags) { say("cuInit %u", flags); initialized = 1; return 0; }
CUresult cuDeviceGetCount(int *n) { NEED_INIT; *n = 1; return 0; }
CUresult cuDeviceGet(int *dev, int ordinal) { NEED_INIT; if (ordinal != 0) return 101; *dev = 0; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    NEED_INIT;
    say("retain %d", dev);
    retained++;
    *ctx = &ctx_token;
    return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
    NEED_INIT;
    say("release %d", dev);
    if (retained == 0) return 201;
    retained--;
    if (retained == 0) current = 0;
    return 0;
}
CUresult cuCtxPushCurrent_v2(void *ctx) { NEED_INIT; if (ctx != &ctx_token || !retained) return 201; current++; return 0; }
CUresult cuCtxPopCurrent_v2(void **ctx) { NEED_INIT; if (!current) return 201; current--; if (ctx) *ctx = &ctx_token; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { NEED_INIT; if (ctx && (ctx != &ctx_token || !retained)) return 201; current = ctx != NULL; return 0; }
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) { NEED_CTX; return do_register(p, n, flags); }
CUresult cuMemHostUnregister(void *p) { NEED_CTX; return do_unregister(p); }
/* "Device memory" is 2 MiB-aligned host memory; allocations are tracked so
 * that frees, copies and exports outside one are refused (1 = INVALID_VALUE). */
static struct { uintptr_t p; size_t n; int sync; } allocs[16];
static int find_alloc(uintptr_t p, size_t n) {
    for (int i = 0; i < 16; i++)
        if (allocs[i].n && p >= allocs[i].p && p + n <= allocs[i].p + allocs[i].n) return i;
    return -1;
}
CUresult cuMemAlloc_v2(unsigned long long *dptr, size_t n) {
    NEED_CTX;
    say("alloc %zu", n);
    for (int i = 0; i < 16; i++)
        if (!allocs[i].n) {
            void *m = aligned_alloc(2 << 20, (n + (2 << 20) - 1) / (2 << 20) * (2 << 20));
            if (!m) return 2;
            allocs[i].p = (uintptr_t)m;
            allocs[i].n = n;
            allocs[i].sync = 0;
            allocated++;
            *dptr = (uintptr_t)m;
            return 0;
        }
    return 2;
}
CUresult cuMemFree_v2(unsigned long long dptr) {
    NEED_CTX;
    say("free %#llx", dptr);
    for (int i = 0; i < 16; i++)
        if (allocs[i].n && allocs[i].p == dptr) {
            free((void *)(uintptr_t)dptr);
            allocs[i].n = 0;
            allocated--;
            return 0;
        }
    return 1;
}
CUresult cuMemcpyHtoD_v2(unsigned long long dst, const void *src, size_t n) {
    NEED_CTX;
    if (find_alloc(dst, n) < 0) return 1;
    memcpy((void *)(uintptr_t)dst, src, n);
    return 0;
}
CUresult cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t n) {
    NEED_CTX;
    if (find_alloc(src, n) < 0) return 1;
    memcpy(dst, (void *)(uintptr_t)src, n);
    return 0;
}
CUresult cuPointerSetAttribute(const void *value, int attr, unsigned long long p) {
    NEED_CTX;
    int i = find_alloc(p, 1);
    say("set attribute %d = %u on %#llx", attr, *(const unsigned *)value, p);
    if (i < 0) return 1;
    if (attr == 6) allocs[i].sync = *(const unsigned *)value;
    return 0;
}
/* The export hands out a memfd standing in for the dma-buf; it requires
 * page-aligned ranges inside one allocation, as the real call does. */
CUresult cuMemGetHandleForAddressRange(void *handle, unsigned long long p, size_t n, int type,
                                       unsigned long long flags) {
    NEED_CTX;
    say("export %#llx %zu type %d flags %llu", p, n, type, flags);
    if (type != 1 || flags != 0 || (p & 4095) || (n & 4095) || find_alloc(p, n) < 0) return 1;
    int fd = memfd_create("fake-dmabuf", 0);
    if (fd < 0 || ftruncate(fd, (off_t)n)) return 2;
    *(int *)handle = fd;
    return 0;
}
#endif

#ifdef FAKE_RUNTIME
/* The runtime creates and makes current the primary context by itself. */
int cudaGetDeviceCount(int *n) { *n = 1; return 0; }
int cudaHostRegister(void *p, size_t n, unsigned flags) { return do_register(p, n, flags); }
int cudaHostUnregister(void *p) { return do_unregister(p); }
const char *cudaGetErrorString(int rc) { return rc == 2 ? "out of memory" : "fake error"; }
#endif
