/*
 * A fake libcuda.so.1 for testing kvpool's CUDA backend WITHOUT a GPU.
 *
 * It proves calling conventions only (argument order, types, return tuples, fd
 * passing, error mapping) -- nothing about real driver behaviour or timing.
 *
 * "Device memory" is host memory: an allocation is a memfd, a reservation is a
 * PROT_NONE anonymous mmap, cuMemMap maps the memfd there with no access and
 * cuMemSetAccess mprotects it read/write, so Python can check bytes through the
 * mapped addresses. Exported handles are dup()ed memfds, so they really cross
 * process boundaries over SCM_RIGHTS.
 *
 * cuda-bindings resolves every entry point through cuGetProcAddress_v2; we answer
 * for the functions kvpool uses and report "not found" for the rest.
 *
 * Knobs (environment variables, read at cuInit):
 *   KVPOOL_STUB_TOTAL      device memory in bytes (default 1 GiB)
 *   KVPOOL_STUB_DEVICES    device count (default 1)
 *   KVPOOL_STUB_INIT_ERROR CUresult cuInit returns (default 0)
 *   KVPOOL_STUB_ATTR_<n>   value of device attribute n (102, 103, 20, 110, ...)
 *   KVPOOL_STUB_LOG        if set, log every call to stderr
 *
 * Build: gcc -shared -fPIC -O1 -o libcuda.so.1 libcuda_stub.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUcontext;
typedef void *CUstream;

enum {
    OK = 0, E_INVALID_VALUE = 1, E_OOM = 2, E_NOT_INITIALIZED = 3,
    E_INVALID_DEVICE = 101, E_INVALID_CONTEXT = 201, E_INVALID_HANDLE = 400,
    E_NOT_FOUND = 500, E_NOT_SUPPORTED = 801,
};

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1 */
    CUmemLocation location;   /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
typedef struct { char bytes[16]; } CUuuid;

#define GRAN (2ull << 20)
#define MAXH 65536
#define MAXR 4096
#define MAXM 65536

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int inited, ndev = 1;
static unsigned long long total = 1ull << 30, used;
static int logging;

struct alloc { int fd; size_t size; int refs; int maps; int live; };
struct resv { CUdeviceptr base; size_t size; };
struct mapping { CUdeviceptr va; size_t size; unsigned long long h; int access; };
static struct alloc allocs[MAXH]; /* handle value = index + 1 */
static struct resv resvs[MAXR];
static struct mapping maps[MAXM];
static int nmaps;
static int primary_refs;
static __thread CUcontext current;
static char ctx_token, stream_token;

#define LOG(...) do { if (logging) fprintf(stderr, "[stub] " __VA_ARGS__); } while (0)

static long envl(const char *name, long dflt) {
    const char *s = getenv(name);
    return s && *s ? strtol(s, NULL, 0) : dflt;
}

static struct alloc *get_alloc(unsigned long long h) {
    if (h == 0 || h > MAXH || !allocs[h - 1].live) return NULL;
    return &allocs[h - 1];
}

static void maybe_free(unsigned long long h) {
    struct alloc *a = &allocs[h - 1];
    if (a->refs == 0 && a->maps == 0) {
        close(a->fd);
        used -= a->size;
        a->live = 0;
    }
}

static struct resv *find_resv(CUdeviceptr va, size_t size) {
    for (int i = 0; i < MAXR; i++)
        if (resvs[i].size && va >= resvs[i].base && va + size <= resvs[i].base + resvs[i].size)
            return &resvs[i];
    return NULL;
}

/* ---- init, errors, devices, contexts ---------------------------------------- */
CUresult cuDriverGetVersion(int *v) { if (!v) return E_INVALID_VALUE; *v = 13000; return OK; }

CUresult cuInit(unsigned int flags) {
    logging = getenv("KVPOOL_STUB_LOG") != NULL;
    LOG("cuInit(%u)\n", flags);
    int err = (int)envl("KVPOOL_STUB_INIT_ERROR", 0);
    if (err) return err;
    total = (unsigned long long)envl("KVPOOL_STUB_TOTAL", 1l << 30);
    ndev = (int)envl("KVPOOL_STUB_DEVICES", 1);
    inited = 1;
    return OK;
}

static const char *err_name(CUresult e) {
    switch (e) {
    case OK: return "CUDA_SUCCESS";
    case E_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case E_OOM: return "CUDA_ERROR_OUT_OF_MEMORY";
    case E_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case 100: return "CUDA_ERROR_NO_DEVICE";
    case E_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case E_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case E_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case 700: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case E_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    default: return NULL;
    }
}
CUresult cuGetErrorName(CUresult e, const char **s) {
    const char *n = err_name(e);
    if (!s || !n) return E_INVALID_VALUE;
    *s = n;
    return OK;
}
CUresult cuGetErrorString(CUresult e, const char **s) {
    const char *n = err_name(e);
    if (!s || !n) return E_INVALID_VALUE;
    *s = "stub driver error";
    return OK;
}

CUresult cuDeviceGetCount(int *n) {
    if (!inited) return E_NOT_INITIALIZED;
    if (!n) return E_INVALID_VALUE;
    *n = ndev;
    return OK;
}
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (!inited) return E_NOT_INITIALIZED;
    if (!d) return E_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= ndev) return E_INVALID_DEVICE;
    *d = ordinal;
    return OK;
}
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    if (!inited) return E_NOT_INITIALIZED;
    if (!v) return E_INVALID_VALUE;
    if (d < 0 || d >= ndev) return E_INVALID_DEVICE;
    char name[64];
    long dflt = (attr == 102 || attr == 103 || attr == 110) ? 1 : 0; /* 20 (compute mode) = 0 */
    snprintf(name, sizeof name, "KVPOOL_STUB_ATTR_%d", attr);
    *v = (int)envl(name, dflt);
    return OK;
}
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) {
    if (!u) return E_INVALID_VALUE;
    if (d < 0 || d >= ndev) return E_INVALID_DEVICE;
    for (int i = 0; i < 16; i++) u->bytes[i] = (char)(0xa0 + i + d);
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    if (!inited) return E_NOT_INITIALIZED;
    if (!c) return E_INVALID_VALUE;
    if (d < 0 || d >= ndev) return E_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    primary_refs++;
    pthread_mutex_unlock(&mu);
    *c = &ctx_token;
    return OK;
}
CUresult cuDevicePrimaryCtxRelease(CUdevice d) {
    if (d < 0 || d >= ndev) return E_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    int bad = primary_refs <= 0;
    if (!bad) primary_refs--;
    pthread_mutex_unlock(&mu);
    return bad ? E_INVALID_CONTEXT : OK;
}
CUresult cuCtxSetCurrent(CUcontext c) {
    if (c && c != &ctx_token) return E_INVALID_CONTEXT;
    current = c;
    return OK;
}
CUresult cuCtxGetCurrent(CUcontext *c) { if (!c) return E_INVALID_VALUE; *c = current; return OK; }
CUresult cuCtxSynchronize(void) { return current ? OK : E_INVALID_CONTEXT; }

CUresult cuMemGetInfo(size_t *free_, size_t *total_) {
    if (!current) return E_INVALID_CONTEXT; /* like the real driver: needs a context */
    if (!free_ || !total_) return E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    *free_ = total - used;
    *total_ = total;
    pthread_mutex_unlock(&mu);
    return OK;
}

/* ---- streams ----------------------------------------------------------------- */
CUresult cuStreamCreate(CUstream *s, unsigned int flags) {
    if (!current) return E_INVALID_CONTEXT;
    if (!s) return E_INVALID_VALUE;
    *s = &stream_token;
    return OK;
}
CUresult cuStreamSynchronize(CUstream s) {
    if (s && s != &stream_token) return E_INVALID_HANDLE;
    return current ? OK : E_INVALID_CONTEXT;
}
CUresult cuStreamDestroy(CUstream s) { return s == &stream_token ? OK : E_INVALID_HANDLE; }

/* ---- VMM --------------------------------------------------------------------- */
static int prop_ok(const CUmemAllocationProp *p) {
    return p && p->type == 1 && p->location.type == 1 && p->location.id >= 0 &&
           p->location.id < ndev;
}

CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, int option) {
    LOG("cuMemGetAllocationGranularity(type=%d, handles=%d, loc=%d/%d, rdma=%d, option=%d)\n",
        p ? p->type : -1, p ? p->requestedHandleTypes : -1, p ? p->location.type : -1,
        p ? p->location.id : -1, p ? p->allocFlags.gpuDirectRDMACapable : -1, option);
    if (!g || !prop_ok(p) || (option != 0 && option != 1)) return E_INVALID_VALUE;
    *g = GRAN;
    return OK;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
    LOG("cuMemAddressReserve(%zu, %zu, %#llx, %llu)\n", size, align, addr, flags);
    if (!ptr || size == 0 || size % 4096 || (align & (align - 1))) return E_INVALID_VALUE;
    if (align < GRAN) align = GRAN;
    void *p = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) return E_OOM;
    uintptr_t base = ((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1);
    if (base > (uintptr_t)p) munmap(p, base - (uintptr_t)p);
    uintptr_t end = (uintptr_t)p + size + align;
    if (end > base + size) munmap((void *)(base + size), end - (base + size));
    pthread_mutex_lock(&mu);
    int slot = -1;
    for (int i = 0; i < MAXR; i++) if (!resvs[i].size) { slot = i; break; }
    if (slot < 0) { pthread_mutex_unlock(&mu); munmap((void *)base, size); return E_OOM; }
    resvs[slot].base = base;
    resvs[slot].size = size;
    pthread_mutex_unlock(&mu);
    *ptr = base;
    return OK;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    LOG("cuMemAddressFree(%#llx, %zu)\n", ptr, size);
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAXR; i++) {
        if (resvs[i].size && resvs[i].base == ptr && resvs[i].size == size) {
            for (int m = 0; m < nmaps; m++)
                if (maps[m].size && maps[m].va >= ptr && maps[m].va < ptr + size) {
                    pthread_mutex_unlock(&mu);
                    return E_INVALID_VALUE; /* still mapped */
                }
            resvs[i].size = 0;
            munmap((void *)ptr, size);
            pthread_mutex_unlock(&mu);
            return OK;
        }
    }
    pthread_mutex_unlock(&mu);
    return E_INVALID_VALUE;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p,
                     unsigned long long flags) {
    LOG("cuMemCreate(%zu, handles=%d, flags=%llu)\n", size, p ? p->requestedHandleTypes : -1, flags);
    if (!h || !prop_ok(p) || size == 0 || size % GRAN || flags) return E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (used + size > total) { pthread_mutex_unlock(&mu); return E_OOM; }
    int slot = -1;
    for (int i = 0; i < MAXH; i++) if (!allocs[i].live) { slot = i; break; }
    if (slot < 0) { pthread_mutex_unlock(&mu); return E_OOM; }
    int fd = memfd_create("stub-cuda-page", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, size) != 0) {
        if (fd >= 0) close(fd);
        pthread_mutex_unlock(&mu);
        return E_OOM;
    }
    allocs[slot] = (struct alloc){fd, size, 1, 0, 1};
    used += size;
    pthread_mutex_unlock(&mu);
    *h = (CUmemGenericAllocationHandle)slot + 1;
    return OK;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    LOG("cuMemRelease(%llu)\n", h);
    pthread_mutex_lock(&mu);
    struct alloc *a = get_alloc(h);
    if (!a || a->refs <= 0) { pthread_mutex_unlock(&mu); return E_INVALID_VALUE; }
    a->refs--;
    maybe_free(h);
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) {
    LOG("cuMemRetainAllocationHandle(%p)\n", addr);
    if (!h) return E_INVALID_VALUE;
    CUdeviceptr va = (CUdeviceptr)(uintptr_t)addr;
    pthread_mutex_lock(&mu);
    for (int m = 0; m < nmaps; m++)
        if (maps[m].size && va >= maps[m].va && va < maps[m].va + maps[m].size) {
            allocs[maps[m].h - 1].refs++;
            *h = maps[m].h;
            pthread_mutex_unlock(&mu);
            return OK;
        }
    pthread_mutex_unlock(&mu);
    return E_INVALID_VALUE;
}

CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                  unsigned long long flags) {
    LOG("cuMemMap(%#llx, %zu, %zu, %llu, %llu)\n", va, size, offset, h, flags);
    if (flags || size == 0 || va % GRAN || size % GRAN || offset % GRAN) return E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    struct alloc *a = get_alloc(h);
    int bad = !a || offset + size > a->size || !find_resv(va, size);
    for (int m = 0; !bad && m < nmaps; m++)
        if (maps[m].size && va < maps[m].va + maps[m].size && maps[m].va < va + size) bad = 1;
    if (bad) { pthread_mutex_unlock(&mu); return a ? E_INVALID_VALUE : E_INVALID_HANDLE; }
    /* a fresh mapping has no access until cuMemSetAccess */
    if (mmap((void *)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, offset) == MAP_FAILED) {
        pthread_mutex_unlock(&mu);
        return E_OOM;
    }
    int slot = -1;
    for (int m = 0; m < nmaps; m++) if (!maps[m].size) { slot = m; break; }
    if (slot < 0) slot = nmaps++;
    maps[slot] = (struct mapping){va, size, h, 0};
    a->maps++;
    pthread_mutex_unlock(&mu);
    return OK;
}

/* bytes of [va, va+size) covered by mappings; -1 if a mapping straddles an edge */
static long long covered(CUdeviceptr va, size_t size, int whole_only) {
    long long n = 0;
    for (int m = 0; m < nmaps; m++) {
        if (!maps[m].size || !(va < maps[m].va + maps[m].size && maps[m].va < va + size)) continue;
        if (whole_only && (maps[m].va < va || maps[m].va + maps[m].size > va + size)) return -1;
        n += maps[m].size;
    }
    return n;
}

CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t count) {
    LOG("cuMemSetAccess(%#llx, %zu, count=%zu, loc=%d/%d, flags=%d)\n", va, size, count,
        desc ? desc->location.type : -1, desc ? desc->location.id : -1, desc ? desc->flags : -1);
    if (!desc || count < 1 || va % GRAN || size % GRAN || size == 0) return E_INVALID_VALUE;
    for (size_t i = 0; i < count; i++)
        if (desc[i].location.type != 1 || desc[i].location.id < 0 ||
            desc[i].location.id >= ndev || desc[i].flags < 0 || desc[i].flags > 3 ||
            desc[i].flags == 2)
            return E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (covered(va, size, 1) != (long long)size) { pthread_mutex_unlock(&mu); return E_INVALID_VALUE; }
    int prot = desc[0].flags == 3 ? PROT_READ | PROT_WRITE : desc[0].flags == 1 ? PROT_READ : PROT_NONE;
    mprotect((void *)va, size, prot);
    for (int m = 0; m < nmaps; m++)
        if (maps[m].size && maps[m].va >= va && maps[m].va < va + size) maps[m].access = desc[0].flags;
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    LOG("cuMemUnmap(%#llx, %zu)\n", va, size);
    if (va % GRAN || size % GRAN || size == 0) return E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    /* must cover whole mappings only, with no never-mapped gaps */
    if (covered(va, size, 1) != (long long)size) { pthread_mutex_unlock(&mu); return E_INVALID_VALUE; }
    for (int m = 0; m < nmaps; m++) {
        if (maps[m].size && maps[m].va >= va && maps[m].va < va + size) {
            unsigned long long h = maps[m].h;
            maps[m].size = 0;
            allocs[h - 1].maps--;
            maybe_free(h);
        }
    }
    mmap((void *)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                      unsigned long long flags) {
    LOG("cuMemExportToShareableHandle(%llu, type=%d, flags=%llu)\n", h, type, flags);
    if (!out || type != 1 || flags) return E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    struct alloc *a = get_alloc(h);
    if (!a || a->refs <= 0) { pthread_mutex_unlock(&mu); return E_INVALID_VALUE; }
    int fd = dup(a->fd);
    pthread_mutex_unlock(&mu);
    if (fd < 0) return E_OOM;
    *(int *)out = fd;
    return OK;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os_handle, int type) {
    int fd = (int)(intptr_t)os_handle; /* POSIX fd passed by value as (void*)(uintptr_t)fd */
    LOG("cuMemImportFromShareableHandle(fd=%d, type=%d)\n", fd, type);
    struct stat st;
    if (!h || type != 1 || fd < 0 || fstat(fd, &st) != 0 || st.st_size <= 0 || st.st_size % GRAN)
        return E_INVALID_VALUE;
    int nfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (nfd < 0) return E_OOM;
    pthread_mutex_lock(&mu);
    int slot = -1;
    for (int i = 0; i < MAXH; i++) if (!allocs[i].live) { slot = i; break; }
    if (slot < 0) { pthread_mutex_unlock(&mu); close(nfd); return E_OOM; }
    allocs[slot] = (struct alloc){nfd, (size_t)st.st_size, 1, 0, 1};
    used += st.st_size; /* counted per process, like per-process accounting would */
    pthread_mutex_unlock(&mu);
    *h = (CUmemGenericAllocationHandle)slot + 1;
    return OK;
}

CUresult cuMemsetD8Async(CUdeviceptr va, unsigned char uc, size_t n, CUstream s) {
    LOG("cuMemsetD8Async(%#llx, %u, %zu)\n", va, uc, n);
    if (!current) return E_INVALID_CONTEXT;
    if (s && s != &stream_token) return E_INVALID_HANDLE;
    pthread_mutex_lock(&mu);
    /* every byte must lie in a read-write mapping */
    long long ok = 0;
    for (int m = 0; m < nmaps; m++)
        if (maps[m].size && maps[m].access == 3 && va < maps[m].va + maps[m].size &&
            maps[m].va < va + n) {
            CUdeviceptr lo = va > maps[m].va ? va : maps[m].va;
            CUdeviceptr hi = va + n < maps[m].va + maps[m].size ? va + n : maps[m].va + maps[m].size;
            ok += hi - lo;
        }
    if (ok != (long long)n) { pthread_mutex_unlock(&mu); return E_INVALID_VALUE; }
    memset((void *)va, uc, n);
    pthread_mutex_unlock(&mu);
    return OK;
}

/* ---- entry point lookup --------------------------------------------------------- */
#define F(name) {#name, (void *)name}
static const struct { const char *name; void *fn; } table[] = {
    F(cuDriverGetVersion), F(cuInit), F(cuGetErrorName), F(cuGetErrorString),
    F(cuDeviceGetCount), F(cuDeviceGet), F(cuDeviceGetAttribute), F(cuDeviceGetUuid),
    F(cuDevicePrimaryCtxRetain), F(cuDevicePrimaryCtxRelease), F(cuCtxSetCurrent),
    F(cuCtxGetCurrent), F(cuCtxSynchronize), F(cuMemGetInfo), F(cuStreamCreate),
    F(cuStreamSynchronize), F(cuStreamDestroy), F(cuMemGetAllocationGranularity),
    F(cuMemAddressReserve), F(cuMemAddressFree), F(cuMemCreate), F(cuMemRelease),
    F(cuMemRetainAllocationHandle), F(cuMemMap), F(cuMemSetAccess), F(cuMemUnmap),
    F(cuMemExportToShareableHandle), F(cuMemImportFromShareableHandle), F(cuMemsetD8Async),
};

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, unsigned long long flags,
                             int *status) {
    if (!sym || !pfn) return E_INVALID_VALUE;
    /* CUDA 13 added cuCtxSynchronize_v2(ctx) etc. under the same base name: only
       answer the versions whose signatures we implement. */
    if (version >= 13000 && (!strcmp(sym, "cuCtxSynchronize") || !strcmp(sym, "cuCtxGetDevice")))
        goto notfound;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (!strcmp(sym, table[i].name)) {
            *pfn = table[i].fn;
            if (status) *status = 0;
            return OK;
        }
notfound:
    *pfn = NULL;
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return E_NOT_FOUND;
}
CUresult cuGetProcAddress(const char *sym, void **pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(sym, pfn, version, flags, NULL);
}
