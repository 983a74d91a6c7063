/*
 * memhog: a deterministic, memory-heavy workload for checkpoint/restore tests.
 *
 *   memhog [--mib N] [--port P] [--file PATH] [--shm PATH]
 *          [--interval-ms MS] [--seed S] [--flip 0|1]
 *
 * Defaults: 16 MiB, no port, no file, no shm, 200 ms, seed 1.
 *
 * - Maps N MiB of anonymous private memory and fills it, as 64-bit words in
 *   order, with the xorshift64 stream (x ^= x << 13; x ^= x >> 7;
 *   x ^= x << 17) started from the seed (seed 0 is replaced by
 *   0x9e3779b97f4a7c15). Every page is touched; MAP_POPULATE faults them in
 *   about three times faster than the fill loop would.
 * - Keeps a counter that starts at 0. Every interval: counter += 1, the word
 *   (unless --flip 0, for a workload whose memory stays the same)
 *   at index splitmix64(counter) % words is inverted (~w), "tick <counter>\n"
 *   is written to stdout, and "<counter>\n" is appended to --file and --shm
 *   through descriptors opened once at start (O_WRONLY|O_APPEND|O_CREAT) and
 *   kept open for the life of the process.
 * - With --port, listens on 0.0.0.0:P (SO_REUSEADDR, backlog 16). Each
 *   connection gets one line and is closed:
 *     "counter=<n> mib=<N> sum=<16 lowercase hex digits>\n"
 *   where sum is FNV-1a 64 over the buffer's words (h ^= w; h *= prime),
 *   offset basis 0xcbf29ce484222325, prime 0x100000001b3, computed at that
 *   moment. Two processes with the same --mib, --seed and counter report the
 *   same sum.
 * - Exits 0 on SIGTERM or SIGINT. One process, one thread, no children.
 *   Ticks are not caught up after a pause: a late tick moves the next
 *   deadline to now + interval.
 *
 * Build: gcc -O2 -static -o memhog memhog.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static uint64_t *buf;
static size_t nwords;
static uint64_t mib = 16;
static uint64_t counter;

static void die(const char *what)
{
    fprintf(stderr, "memhog: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void usage(void)
{
    fprintf(stderr, "usage: memhog [--mib N] [--port P] [--file PATH] [--shm PATH] "
                    "[--interval-ms MS] [--seed S] [--flip 0|1]\n");
    exit(2);
}

static uint64_t parse_u64(const char *s, uint64_t max)
{
    char *end;
    unsigned long long v;

    if (s == NULL || *s < '0' || *s > '9')
        usage();
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0' || v > max)
        usage();
    return v;
}

static uint64_t xorshift64(uint64_t *state)
{
    uint64_t x = *state;

    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    return x;
}

static uint64_t splitmix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t checksum(void)
{
    uint64_t h = 0xcbf29ce484222325ULL;
    size_t i;

    for (i = 0; i < nwords; i++) {
        h ^= buf[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

static void write_all(int fd, const char *s, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, s, len);

        if (n < 0) {
            if (errno == EINTR)
                continue;
            return; /* a closed stdout or peer must not stop the workload */
        }
        s += n;
        len -= (size_t)n;
    }
}

static int64_t now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void on_term(int sig)
{
    (void)sig;
    _exit(0);
}

static int open_append(const char *path)
{
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);

    if (fd < 0)
        die(path);
    return fd;
}

static int listen_on(uint64_t port)
{
    struct sockaddr_in addr;
    int one = 1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);

    if (fd < 0)
        die("socket");
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0)
        die("setsockopt");
    memset(&addr, 0, sizeof(addr));
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons((uint16_t)port);
    if (bind(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0)
        die("bind");
    if (listen(fd, 16) < 0)
        die("listen");
    return fd;
}

static void serve(int lfd)
{
    char line[128];

    for (;;) {
        int cfd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        int len;

        if (cfd < 0) {
            if (errno == EINTR)
                continue;
            return; /* EAGAIN, or a connection that went away */
        }
        len = snprintf(line, sizeof(line), "counter=%" PRIu64 " mib=%" PRIu64 " sum=%016" PRIx64 "\n",
                       counter, mib, checksum());
        write_all(cfd, line, (size_t)len);
        close(cfd);
    }
}

static int flip = 1;

static void tick(int file_fd, int shm_fd)
{
    char line[64];
    int len;

    counter++;
    if (flip && nwords > 0) {
        size_t idx = (size_t)(splitmix64(counter) % nwords);

        buf[idx] = ~buf[idx];
    }
    len = snprintf(line, sizeof(line), "tick %" PRIu64 "\n", counter);
    write_all(STDOUT_FILENO, line, (size_t)len);
    len = snprintf(line, sizeof(line), "%" PRIu64 "\n", counter);
    if (file_fd >= 0)
        write_all(file_fd, line, (size_t)len);
    if (shm_fd >= 0)
        write_all(shm_fd, line, (size_t)len);
}

int main(int argc, char **argv)
{
    const char *file = NULL, *shm = NULL;
    uint64_t interval = 200, seed = 1, state;
    int64_t port = -1;
    int file_fd = -1, shm_fd = -1, lfd = -1;
    struct sigaction sa;
    struct pollfd pfd;
    int64_t next;
    size_t i;
    int a;

    for (a = 1; a < argc; a++) {
        const char *opt = argv[a];
        const char *val = a + 1 < argc ? argv[a + 1] : NULL;

        if (val == NULL)
            usage();
        if (strcmp(opt, "--mib") == 0)
            mib = parse_u64(val, (uint64_t)1 << 20);
        else if (strcmp(opt, "--port") == 0)
            port = (int64_t)parse_u64(val, 65535);
        else if (strcmp(opt, "--file") == 0)
            file = val;
        else if (strcmp(opt, "--shm") == 0)
            shm = val;
        else if (strcmp(opt, "--interval-ms") == 0)
            interval = parse_u64(val, 86400000);
        else if (strcmp(opt, "--seed") == 0)
            seed = parse_u64(val, UINT64_MAX);
        else if (strcmp(opt, "--flip") == 0)
            flip = (int)parse_u64(val, 1);
        else
            usage();
        a++;
    }
    if (interval == 0)
        usage();

    memset(&sa, 0, sizeof(sa));
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &sa, NULL);

    nwords = (size_t)(mib * 1024 * 1024 / sizeof(uint64_t));
    if (nwords > 0) {
        buf = mmap(NULL, nwords * sizeof(uint64_t), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (buf == MAP_FAILED)
            die("mmap");
    }
    state = seed != 0 ? seed : 0x9e3779b97f4a7c15ULL;
    for (i = 0; i < nwords; i++)
        buf[i] = xorshift64(&state);

    if (file != NULL)
        file_fd = open_append(file);
    if (shm != NULL)
        shm_fd = open_append(shm);
    if (port >= 0)
        lfd = listen_on((uint64_t)port);
    pfd.fd = lfd;
    pfd.events = POLLIN;
    pfd.revents = 0;

    next = now_ms() + (int64_t)interval;
    for (;;) {
        int64_t now = now_ms();
        int n;

        if (now >= next) {
            tick(file_fd, shm_fd);
            next += (int64_t)interval;
            if (next <= now)
                next = now + (int64_t)interval;
            continue;
        }
        n = poll(&pfd, lfd >= 0 ? 1 : 0, (int)(next - now));
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("poll");
        }
        if (n > 0 && (pfd.revents & POLLIN))
            serve(lfd);
    }
}
