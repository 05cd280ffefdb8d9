/*
 * The wall clock of a test process, shifted or frozen: an LD_PRELOAD library that
 * interposes clock_gettime (CLOCK_REALTIME and CLOCK_REALTIME_COARSE only),
 * gettimeofday and time. Every other clock passes through untouched.
 *
 * The state is a file named by DISTLOCK_CLOCK_FILE: two little-endian int64, offset_ns
 * (added to the real wall clock) and frozen_at_ns (0: not frozen; otherwise the wall
 * clock reads exactly this). It is mapped shared in the constructor, so writing the file
 * changes the clock of a running process and of the children it forks. Without the
 * variable or the file, the functions behave as libc's.
 *
 * Nothing here allocates: Redis's jemalloc reads the clock while it initializes.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* struct timeval comes from <sys/types.h>; <sys/time.h> is left out because its
 * declaration marks gettimeofday's tv nonnull, which libc does not require. */

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the state file holds little-endian integers"
#endif

#define EXPORT __attribute__((visibility("default")))
#define NS_PER_SEC 1000000000LL
#define STATE_LEN 16

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);
typedef int (*gettimeofday_fn)(struct timeval *restrict, void *restrict);
typedef time_t (*time_fn)(time_t *);

/* NULL until the constructor ran: then the raw system calls stand in. */
static clock_gettime_fn real_clock_gettime;
static gettimeofday_fn real_gettimeofday;
static time_fn real_time;
/* offset_ns, frozen_at_ns; NULL when the clock is not shifted. */
static const int64_t *state;

__attribute__((constructor)) static void init(void) {
    real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    real_gettimeofday = (gettimeofday_fn)dlsym(RTLD_NEXT, "gettimeofday");
    real_time = (time_fn)dlsym(RTLD_NEXT, "time");

    const char *path = getenv("DISTLOCK_CLOCK_FILE");
    if (path == NULL || *path == '\0')
        return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    struct stat st;
    /* A shorter file would raise SIGBUS on the first read of the mapping. */
    if (fstat(fd, &st) == 0 && st.st_size >= STATE_LEN) {
        void *mapped = mmap(NULL, STATE_LEN, PROT_READ, MAP_SHARED, fd, 0);
        if (mapped != MAP_FAILED)
            __atomic_store_n(&state, (const int64_t *)mapped, __ATOMIC_RELEASE);
    }
    close(fd);
}

/*
 * Reads the state; 0 when the clock is not shifted. The test writes the file with
 * pwrite, whose copy into the page is not atomic for a reader of the mapping, so a pair
 * is taken once two reads in a row agree.
 */
static int read_state(int64_t *offset, int64_t *frozen) {
    const int64_t *s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == NULL)
        return 0;
    int64_t o = __atomic_load_n(&s[0], __ATOMIC_ACQUIRE);
    int64_t f = __atomic_load_n(&s[1], __ATOMIC_ACQUIRE);
    for (int i = 0; i < 100; i++) {
        int64_t o2 = __atomic_load_n(&s[0], __ATOMIC_ACQUIRE);
        int64_t f2 = __atomic_load_n(&s[1], __ATOMIC_ACQUIRE);
        if (o2 == o && f2 == f)
            break;
        o = o2;
        f = f2;
    }
    *offset = o;
    *frozen = f;
    return 1;
}

/* The shifted reading for a real reading of the wall clock, in nanoseconds. */
static int64_t shift(int64_t real_ns, int64_t offset, int64_t frozen) {
    return frozen != 0 ? frozen : real_ns + offset;
}

/* Floor division, so that readings before 1970 split into a valid (sec, fraction). */
static void split(int64_t ns, int64_t unit, int64_t *sec, int64_t *fraction) {
    int64_t per_sec = NS_PER_SEC / unit;
    int64_t units = ns / unit - (ns % unit < 0);
    *sec = units / per_sec - (units % per_sec < 0);
    *fraction = units - *sec * per_sec;
}

static int read_clock(clockid_t id, struct timespec *ts) {
    if (real_clock_gettime != NULL)
        return real_clock_gettime(id, ts);
    return (int)syscall(SYS_clock_gettime, id, ts);
}

EXPORT int clock_gettime(clockid_t id, struct timespec *ts) {
    int rc = read_clock(id, ts);
    int64_t offset, frozen;
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE) &&
        read_state(&offset, &frozen)) {
        int64_t real = (int64_t)ts->tv_sec * NS_PER_SEC + ts->tv_nsec;
        int64_t sec, nsec;
        split(shift(real, offset, frozen), 1, &sec, &nsec);
        ts->tv_sec = (time_t)sec;
        ts->tv_nsec = (long)nsec;
    }
    return rc;
}

EXPORT int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    int rc = real_gettimeofday != NULL ? real_gettimeofday(tv, tz)
                                       : (int)syscall(SYS_gettimeofday, tv, tz);
    int64_t offset, frozen;
    if (rc == 0 && tv != NULL && read_state(&offset, &frozen)) {
        int64_t real = (int64_t)tv->tv_sec * NS_PER_SEC + (int64_t)tv->tv_usec * 1000;
        int64_t sec, usec;
        split(shift(real, offset, frozen), 1000, &sec, &usec);
        tv->tv_sec = (time_t)sec;
        tv->tv_usec = (suseconds_t)usec;
    }
    return rc;
}

EXPORT time_t time(time_t *tloc) {
    int64_t offset, frozen;
    if (!read_state(&offset, &frozen)) {
        if (real_time != NULL)
            return real_time(tloc);
        return (time_t)syscall(SYS_time, tloc);
    }
    /* libc's time() reads the coarse clock too. */
    struct timespec ts;
    if (read_clock(CLOCK_REALTIME_COARSE, &ts) != 0)
        return (time_t)-1;
    int64_t real = (int64_t)ts.tv_sec * NS_PER_SEC + ts.tv_nsec;
    int64_t sec, nsec;
    split(shift(real, offset, frozen), 1, &sec, &nsec);
    if (tloc != NULL)
        *tloc = (time_t)sec;
    return (time_t)sec;
}
