/* The raw read ceiling behind benchmarks/roofline.py: how fast T threads can load a buffer far
 * larger than the last-level cache share, with nothing else to do.
 *
 *   cc -O3 -march=native -pthread benchmarks/mem_read.c -o /tmp/mem_read && /tmp/mem_read 2 600
 *
 * Prints GB/s for each of 8 passes (threads, megabytes). ONNX Runtime's MatMul streaming at a
 * high fraction of this is memory-bound; the gap is all any kernel could still win.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* GCC/Clang vector extensions: 64-byte vectors on any target, one register each with AVX-512. */
typedef unsigned long long v8 __attribute__((vector_size(64)));
static v8 *buf;

typedef struct { size_t begin, end; unsigned long long sum; } span;

static void *reader(void *arg) {
    span *s = arg;
    v8 a = {0}, b = {0}, c = {0}, d = {0};  /* four independent chains keep four loads in flight */
    for (size_t i = s->begin; i < s->end; i += 4) {
        a ^= buf[i];
        b ^= buf[i + 1];
        c ^= buf[i + 2];
        d ^= buf[i + 3];
    }
    v8 x = a ^ b ^ c ^ d;
    for (int j = 0; j < 8; j++) s->sum ^= x[j];
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    size_t mb = argc > 2 ? strtoul(argv[2], NULL, 10) : 600;
    if (threads < 1 || threads > 64 || mb < 1) return fprintf(stderr, "usage: mem_read THREADS MEGABYTES\n"), 2;
    size_t n = mb * 1000000 / sizeof *buf / (4 * threads) * (4 * threads);
    buf = aligned_alloc(1 << 21, n * sizeof *buf);
    if (!buf) return perror("aligned_alloc"), 1;
    memset(buf, 0, n * sizeof *buf);
    pthread_t tid[64];
    span spans[64];
    for (int pass = 0; pass < 8; pass++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (int t = 0; t < threads; t++) {
            spans[t] = (span){n / threads * t, n / threads * (t + 1), 0};
            pthread_create(&tid[t], NULL, reader, &spans[t]);
        }
        unsigned long long total = 0;
        for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL), total ^= spans[t].sum;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
        printf("%d threads, %zu MB: %.1f GB/s%s\n", threads, mb, n * sizeof *buf / s / 1e9, total != 0 ? " (!)" : "");
    }
    return 0;
}
