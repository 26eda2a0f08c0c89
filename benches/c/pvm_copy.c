/*
 * How fast the kernel copies between two processes of this host, the same-host plane's copy
 * (docs/performance.md, "Same host"): process_vm_readv and process_vm_writev of one block per
 * call between this process and a child's buffer, against a memcpy of the same blocks, best of
 * three passes over 2 GiB.
 *
 *   cc -O2 -o /tmp/pvm_copy benches/c/pvm_copy.c && /tmp/pvm_copy BLOCK [HUGE]
 *
 * BLOCK is the bytes per call (65536, 1048576); HUGE 1 advises transparent huge pages for both
 * buffers (MADV_HUGEPAGE), 0 (the default) forbids them. Run it as a user that may trace its
 * own children (any user under Yama 0 or 1).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static char *buffer(size_t len, int huge, int fill) {
    char *m = aligned_alloc(2 << 20, len);
    if (!m) exit(1);
    madvise(m, len, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    memset(m, fill, len);
    return m;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s BLOCK [HUGE]\n", argv[0]);
        return 2;
    }
    size_t blk = strtoul(argv[1], NULL, 10), total = 1UL << 31, seg = 64 << 20;
    int huge = argc > 2 && atoi(argv[2]);
    if (blk == 0 || blk > seg) return 2;
    int go[2], addr[2];
    if (pipe(go) || pipe(addr)) return 1;
    pid_t child = fork();
    if (child == 0) {
        /* The other process: its own private buffer, kept until the parent is done. */
        char *m = buffer(seg, huge, 1), c;
        if (write(addr[1], &m, sizeof m) != sizeof m) _exit(1);
        if (read(go[0], &c, 1) < 0) _exit(1);
        _exit(0);
    }
    char *remote;
    if (read(addr[0], &remote, sizeof remote) != sizeof remote) return 1;
    char *local = buffer(seg, huge, 2), *other = buffer(seg, huge, 3);
    for (int dir = 0; dir < 2; dir++) {
        double best = 0;
        for (int pass = 0; pass < 3; pass++) {
            double t0 = now();
            for (size_t moved = 0, off = 0; moved < total; moved += blk) {
                struct iovec l = {local + off, blk}, r = {remote + off, blk};
                ssize_t n = dir == 0 ? process_vm_readv(child, &l, 1, &r, 1, 0)
                                     : process_vm_writev(child, &l, 1, &r, 1, 0);
                if (n != (ssize_t)blk) {
                    perror("process_vm");
                    return 1;
                }
                off = off + 2 * blk > seg ? 0 : off + blk;
            }
            double g = total / (now() - t0) / 1e9;
            if (g > best) best = g;
        }
        double t0 = now();
        for (size_t moved = 0, off = 0; moved < total; moved += blk) {
            memcpy(dir ? other + off : local + off, dir ? local + off : other + off, blk);
            off = off + 2 * blk > seg ? 0 : off + blk;
        }
        printf("block %zu, huge pages %s, %s: %.2f GB/s; memcpy %.2f GB/s\n", blk,
               huge ? "advised" : "off", dir == 0 ? "process_vm_readv" : "process_vm_writev",
               best, total / (now() - t0) / 1e9);
    }
    if (write(go[1], "x", 1) != 1) return 1;
    waitpid(child, NULL, 0);
    return 0;
}
