/* A CUDA injection library that times every kernel, copy and memset of a program with CUPTI's
 * activity API, for scripts/gpu_profile.py --tracer cupti (issue 38's "where does a GPU step go").
 *
 * The CUDA driver loads the library named by CUDA_INJECTION64_PATH when the program initializes
 * CUDA and calls its InitializeInjection(); at exit the library writes one line per kernel name
 * to the file CUPTI_TRACE_OUT names (created: an existing file is refused, not written over):
 *
 *     kernel<TAB>total ns<TAB>launches<TAB>name
 *     memcpy<TAB>total ns<TAB>count<TAB>-        (and memset)
 *     span<TAB>last end - first start (ns)<TAB>records<TAB>-
 *
 * It works where Nsight Compute cannot read the hardware counters (gVisor) and does not
 * serialize the kernels: the program runs at its own pace. A tool, not part of the library;
 * build: gcc -O2 -shared -fPIC -I CUPTI_INCLUDE cupti_trace.c -L CUPTI_LIB -lcupti -lpthread. */
#include <cupti.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUFFER_BYTES (16u << 20)
#define MAX_NAMES 8192

typedef struct {
    char *name;
    unsigned long long ns;
    unsigned long long count;
} Entry;

static Entry names[MAX_NAMES];
static size_t used;
static unsigned long long other_ns[2], other_count[2]; /* memcpy, memset */
static unsigned long long first_start = ~0ull, last_end, records, dropped;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void span(unsigned long long start, unsigned long long end) {
    if (start < first_start) first_start = start;
    if (end > last_end) last_end = end;
    records++;
}

/* Adds one kernel's time under its name (called with the lock held). */
static void add_kernel(const char *name, unsigned long long start, unsigned long long end) {
    const char *n = name ? name : "(unnamed)";
    size_t i;
    span(start, end);
    for (i = 0; i < used; i++) {
        if (strcmp(names[i].name, n) == 0) break;
    }
    if (i == used) {
        if (used == MAX_NAMES) {
            dropped++;
            return;
        }
        names[i].name = strdup(n);
        if (!names[i].name) {
            dropped++;
            return;
        }
        used++;
    }
    names[i].ns += end - start;
    names[i].count++;
}

static void CUPTIAPI requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(ACTIVITY_RECORD_ALIGNMENT, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                               size_t valid) {
    CUpti_Activity *record = NULL;
    (void)ctx;
    (void)stream;
    (void)size;
    pthread_mutex_lock(&lock);
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        switch (record->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
            CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *)record;
            add_kernel(k->name, k->start, k->end);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *)record;
            span(m->start, m->end);
            other_ns[0] += m->end - m->start;
            other_count[0]++;
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            CUpti_ActivityMemset4 *m = (CUpti_ActivityMemset4 *)record;
            span(m->start, m->end);
            other_ns[1] += m->end - m->start;
            other_count[1]++;
            break;
        }
        default:
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    free(buffer);
}

static void report(void) {
    const char *path = getenv("CUPTI_TRACE_OUT");
    FILE *out;
    size_t i;
    cuptiActivityFlushAll(1);
    /* "x": a new file only, never one that is already there. */
    out = path ? fopen(path, "wx") : stderr;
    if (!out) {
        fprintf(stderr, "cupti_trace: cannot create CUPTI_TRACE_OUT=%s: %s\n", path,
                strerror(errno));
        return;
    }
    pthread_mutex_lock(&lock);
    for (i = 0; i < used; i++) {
        fprintf(out, "kernel\t%llu\t%llu\t%s\n", names[i].ns, names[i].count, names[i].name);
    }
    fprintf(out, "memcpy\t%llu\t%llu\t-\n", other_ns[0], other_count[0]);
    fprintf(out, "memset\t%llu\t%llu\t-\n", other_ns[1], other_count[1]);
    fprintf(out, "span\t%llu\t%llu\t-\n", records ? last_end - first_start : 0ull, records);
    fprintf(out, "dropped\t0\t%llu\t-\n", dropped);
    pthread_mutex_unlock(&lock);
    if (out != stderr) fclose(out);
}

/* Called by the CUDA driver; 1 means success. */
int InitializeInjection(void) {
    static const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                               CUPTI_ACTIVITY_KIND_MEMCPY,
                                               CUPTI_ACTIVITY_KIND_MEMSET};
    size_t i;
    if (cuptiActivityRegisterCallbacks(requested, completed) != CUPTI_SUCCESS) {
        fprintf(stderr, "cupti_trace: cuptiActivityRegisterCallbacks failed\n");
        return 0;
    }
    for (i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        CUptiResult r = cuptiActivityEnable(kinds[i]);
        if (r != CUPTI_SUCCESS && kinds[i] == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            /* The serialized kernel records, where concurrent ones are refused. */
            r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_KERNEL);
        }
        if (r != CUPTI_SUCCESS) {
            const char *why = "?";
            cuptiGetResultString(r, &why);
            fprintf(stderr, "cupti_trace: enabling activity kind %d: %s\n", (int)kinds[i], why);
            return 0;
        }
    }
    atexit(report);
    return 1;
}
