/*
 * kvmcheck: what a container process sees of a device node, and whether it can run a VM through it,
 * printed as one JSON line.
 *
 *   kvmcheck [--as UID:GID] [--hold] [--expect-guest] [PATH]        PATH defaults to /dev/kvm
 *
 * In order: stat PATH (as the container's first process sees it), read the container's cgroup v1
 * device rules if they are readable, drop to UID:GID (no supplementary groups) if asked, then open
 * PATH read-write and ask it KVM_GET_API_VERSION. If that answers, it is a tiny VMM: KVM_CREATE_VM,
 * one memory slot holding a few instructions, one vCPU, and KVM_RUN until the guest stops. The guest
 * writes GUEST_TEXT one byte at a time, each a vCPU exit to this program, then stops: on x86-64 a
 * real-mode guest writes to I/O port GUEST_PORT and halts (KVM_EXIT_IO, then KVM_EXIT_HLT); on arm64
 * the vCPU is set up with KVM_ARM_PREFERRED_TARGET and KVM_ARM_VCPU_INIT (PSCI 0.2), its PC set to
 * the code, and the guest stores to GUEST_MMIO, an address no memory slot backs, then asks PSCI for
 * SYSTEM_OFF (KVM_EXIT_MMIO, then KVM_EXIT_SYSTEM_EVENT). "vm" in the line says which step failed
 * (with its errno) or what the guest wrote and how it stopped ("finished": by its own last step).
 *
 * Exit status 0 whenever the JSON line was printed, the verdict being in the line; with
 * --expect-guest, 3 unless the guest finished having written GUEST_TEXT. With --hold the process then
 * waits for SIGTERM or SIGINT (as PID 1 of a container it must catch them), so that a runtime's view
 * of the running container can be read.
 *
 * Built with `gcc -static` (for arm64 `aarch64-linux-gnu-gcc -static`) so that an image holding only
 * this file can run it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/kvm.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

/* A guest that never stops is stopped after this many exits. */
#define MAX_EXITS 256

/* The guest: its code at the start of one memory slot at guest-physical GUEST_BASE, GUEST_TEXT at
 * TEXT_OFFSET in it. */
#if defined(__x86_64__)
#define GUEST_ARCH "x86_64"
#define GUEST_TEXT "kvm guest: hello from real mode\n"
#define GUEST_PORT 0x3f8
#define GUEST_BASE 0x1000
#define GUEST_SIZE 0x1000
#define TEXT_OFFSET 0x20

/*
 * 16-bit real-mode code: print the NUL-terminated string at GUEST_BASE + TEXT_OFFSET to GUEST_PORT.
 *   mov dx, GUEST_PORT; mov si, text; next: lodsb; test al, al; jz done; out dx, al; jmp next; done: hlt
 */
static const uint8_t GUEST_CODE[] = {
    0xba, GUEST_PORT & 0xff, GUEST_PORT >> 8,                                     /* mov dx, imm16 */
    0xbe, (GUEST_BASE + TEXT_OFFSET) & 0xff, (GUEST_BASE + TEXT_OFFSET) >> 8, /* mov si, imm16 */
    0xac,                                                                     /* next: lodsb */
    0x84, 0xc0,                                                               /* test al, al */
    0x74, 0x03,                                                               /* jz done */
    0xee,                                                                     /* out dx, al */
    0xeb, 0xf8,                                                               /* jmp next */
    0xf4,                                                                     /* done: hlt */
};
#elif defined(__aarch64__)
#define GUEST_ARCH "aarch64"
#define GUEST_TEXT "kvm guest: hello from aarch64\n"
/* Where the guest stores each byte: no slot backs it, so each store is a KVM_EXIT_MMIO. */
#define GUEST_MMIO 0x09000000
/* 64 KiB: a whole page whatever the host kernel's page size. */
#define GUEST_BASE 0x10000
#define GUEST_SIZE 0x10000
#define TEXT_OFFSET 0x40
/* PSCI 0.2 SYSTEM_OFF, which KVM answers with KVM_EXIT_SYSTEM_EVENT (KVM_SYSTEM_EVENT_SHUTDOWN). */
#define PSCI_SYSTEM_OFF 0x84000008

/*
 * A64 code, EL1 with the MMU off: store each byte of the NUL-terminated string at TEXT_OFFSET (from the
 * code's start) to GUEST_MMIO, then SYSTEM_OFF.
 */
static const uint32_t GUEST_CODE[] = {
    0xd2a12001, /* mov  x1, #GUEST_MMIO */
    0x100001e2, /* adr  x2, text (TEXT_OFFSET from the start) */
    0x38401443, /* next: ldrb w3, [x2], #1 */
    0x34000063, /* cbz  w3, done */
    0x39000023, /* strb w3, [x1] */
    0x17fffffd, /* b    next */
    0x52800100, /* done: mov w0, #(PSCI_SYSTEM_OFF & 0xffff) */
    0x72b08000, /* movk w0, #(PSCI_SYSTEM_OFF >> 16), lsl #16 */
    0xd4000002, /* hvc  #0 */
    0x14000000, /* b    . */
};
#else
#error "kvmcheck has a guest for x86-64 and arm64 only"
#endif

static const char *const CGROUP_DEVICE_LISTS[] = {
    "/sys/fs/cgroup/devices/devices.list",
    "/sys/fs/cgroup/devices.list",
};

static void json_string(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20 || c >= 0x7f)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static void print_ids(void)
{
    gid_t groups[64];
    int n = getgroups(64, groups);
    printf("\"uid\":%u,\"gid\":%u,\"groups\":[", (unsigned)geteuid(), (unsigned)getegid());
    for (int i = 0; i < n; i++)
        printf("%s%u", i ? "," : "", (unsigned)groups[i]);
    putchar(']');
}

static void print_cgroup_rules(void)
{
    FILE *f = NULL;
    for (size_t i = 0; i < sizeof CGROUP_DEVICE_LISTS / sizeof *CGROUP_DEVICE_LISTS && !f; i++)
        f = fopen(CGROUP_DEVICE_LISTS[i], "re");
    if (!f) {
        printf("\"cgroup_devices\":null");
        return;
    }
    char line[256];
    int first = 1;
    printf("\"cgroup_devices\":[");
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        if (!first)
            putchar(',');
        json_string(line);
        first = 0;
    }
    putchar(']');
    fclose(f);
}

struct guest_run {
    const char *failed_step; /* NULL: every step worked and KVM_RUN ran */
    int error;               /* errno of the failed step */
    int exit_reason;         /* the last KVM_EXIT_* seen, -1 before the first */
    int finished;            /* the guest stopped by its own last step (HLT, SYSTEM_OFF) */
    unsigned exits;
    char output[256];
    size_t len;
};

static int fail(struct guest_run *run, const char *step)
{
    run->failed_step = step;
    run->error = errno;
    return -1;
}

static void guest_wrote(struct guest_run *run, char c)
{
    if (run->len + 1 < sizeof run->output)
        run->output[run->len++] = c;
    run->output[run->len] = '\0';
}

#if defined(__x86_64__)
/* Take one exit of the vCPU: 1 to run again, 0 when the guest is done (halted or stopped). */
static int take_exit(struct guest_run *run, const struct kvm_run *state)
{
    run->exit_reason = (int)state->exit_reason;
    if (state->exit_reason == KVM_EXIT_HLT)
        run->finished = 1;
    if (state->exit_reason != KVM_EXIT_IO)
        return 0;
    if (state->io.direction != KVM_EXIT_IO_OUT || state->io.port != GUEST_PORT || state->io.size != 1)
        return 0;
    const char *data = (const char *)state + state->io.data_offset;
    for (uint32_t i = 0; i < state->io.count; i++)
        guest_wrote(run, data[i]);
    return run->exits < MAX_EXITS;
}

/* Real mode with flat segments at 0: the code segment starts where the slot does. */
static int set_up_vcpu(int vm, int vcpu, struct guest_run *run)
{
    (void)vm;
    struct kvm_sregs sregs;
    if (ioctl(vcpu, KVM_GET_SREGS, &sregs) < 0)
        return fail(run, "KVM_GET_SREGS");
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    if (ioctl(vcpu, KVM_SET_SREGS, &sregs) < 0)
        return fail(run, "KVM_SET_SREGS");
    struct kvm_regs regs = {.rip = GUEST_BASE, .rflags = 0x2};
    if (ioctl(vcpu, KVM_SET_REGS, &regs) < 0)
        return fail(run, "KVM_SET_REGS");
    return 0;
}
#elif defined(__aarch64__)
static int take_exit(struct guest_run *run, const struct kvm_run *state)
{
    run->exit_reason = (int)state->exit_reason;
    if (state->exit_reason == KVM_EXIT_SYSTEM_EVENT && state->system_event.type == KVM_SYSTEM_EVENT_SHUTDOWN)
        run->finished = 1;
    if (state->exit_reason != KVM_EXIT_MMIO)
        return 0;
    if (!state->mmio.is_write || state->mmio.phys_addr != GUEST_MMIO || state->mmio.len != 1)
        return 0;
    guest_wrote(run, (char)state->mmio.data[0]);
    return run->exits < MAX_EXITS;
}

/* The host's preferred CPU target with PSCI 0.2, and the PC at the code (the reset state is EL1h with
 * interrupts masked and the MMU off). */
static int set_up_vcpu(int vm, int vcpu, struct guest_run *run)
{
    struct kvm_vcpu_init init;
    if (ioctl(vm, KVM_ARM_PREFERRED_TARGET, &init) < 0)
        return fail(run, "KVM_ARM_PREFERRED_TARGET");
    init.features[0] |= 1u << KVM_ARM_VCPU_PSCI_0_2;
    if (ioctl(vcpu, KVM_ARM_VCPU_INIT, &init) < 0)
        return fail(run, "KVM_ARM_VCPU_INIT");
    uint64_t pc = GUEST_BASE;
    struct kvm_one_reg reg = {
        .id = KVM_REG_ARM64 | KVM_REG_SIZE_U64 | KVM_REG_ARM_CORE | KVM_REG_ARM_CORE_REG(regs.pc),
        .addr = (uintptr_t)&pc,
    };
    if (ioctl(vcpu, KVM_SET_ONE_REG, &reg) < 0)
        return fail(run, "KVM_SET_ONE_REG pc");
    return 0;
}
#endif

/* The tiny VMM: one VM, one memory slot, one vCPU, run until the guest stops. */
static int run_guest(int kvm, struct guest_run *run)
{
    int vm = ioctl(kvm, KVM_CREATE_VM, 0);
    if (vm < 0)
        return fail(run, "KVM_CREATE_VM");

    uint8_t *mem = mmap(NULL, GUEST_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED)
        return fail(run, "mmap guest memory");
    memcpy(mem, GUEST_CODE, sizeof GUEST_CODE);
    memcpy(mem + TEXT_OFFSET, GUEST_TEXT, sizeof GUEST_TEXT);

    struct kvm_userspace_memory_region region = {
        .slot = 0,
        .guest_phys_addr = GUEST_BASE,
        .memory_size = GUEST_SIZE,
        .userspace_addr = (uintptr_t)mem,
    };
    if (ioctl(vm, KVM_SET_USER_MEMORY_REGION, &region) < 0)
        return fail(run, "KVM_SET_USER_MEMORY_REGION");

    int vcpu = ioctl(vm, KVM_CREATE_VCPU, 0);
    if (vcpu < 0)
        return fail(run, "KVM_CREATE_VCPU");
    int size = ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0);
    if (size < 0)
        return fail(run, "KVM_GET_VCPU_MMAP_SIZE");
    struct kvm_run *state = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, vcpu, 0);
    if (state == MAP_FAILED)
        return fail(run, "mmap kvm_run");
    if (set_up_vcpu(vm, vcpu, run) < 0)
        return -1;

    for (;;) {
        if (ioctl(vcpu, KVM_RUN, 0) < 0) {
            if (errno == EINTR)
                continue;
            return fail(run, "KVM_RUN");
        }
        run->exits++;
        if (!take_exit(run, state))
            break;
    }
    munmap(state, (size_t)size);
    munmap(mem, GUEST_SIZE);
    close(vcpu);
    close(vm);
    return 0;
}

/* Prints "vm"; returns whether the guest finished having written GUEST_TEXT. */
static int print_guest_run(int kvm)
{
    struct guest_run run = {.exit_reason = -1};
    run_guest(kvm, &run);
    printf(",\"vm\":{\"arch\":\"" GUEST_ARCH "\",\"failed_step\":");
    if (run.failed_step)
        json_string(run.failed_step);
    else
        printf("null");
    printf(",\"errno\":%d,\"exit_reason\":%d,\"finished\":%s,\"exits\":%u,\"output\":", run.error,
           run.exit_reason, run.finished ? "true" : "false", run.exits);
    json_string(run.output);
    putchar('}');
    return !run.failed_step && run.finished && strcmp(run.output, GUEST_TEXT) == 0;
}

static volatile sig_atomic_t stop_requested;

static void on_stop(int sig)
{
    (void)sig;
    stop_requested = 1;
}

/* Wait for SIGTERM or SIGINT (blocked outside sigsuspend, so none is lost). */
static void hold(void)
{
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    sigprocmask(SIG_BLOCK, &block, &old);
    struct sigaction sa = {.sa_handler = on_stop};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    while (!stop_requested)
        sigsuspend(&old);
}

static int finish(int do_hold, int status)
{
    fflush(stdout);
    if (do_hold)
        hold();
    return status;
}

int main(int argc, char **argv)
{
    const char *path = "/dev/kvm";
    int drop = 0, do_hold = 0, expect_guest = 0;
    unsigned uid = 0, gid = 0;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--as") == 0 && i + 1 < argc) {
            if (sscanf(argv[++i], "%u:%u", &uid, &gid) != 2) {
                fprintf(stderr, "kvmcheck: --as wants UID:GID\n");
                return 2;
            }
            drop = 1;
        } else if (strcmp(argv[i], "--hold") == 0) {
            do_hold = 1;
        } else if (strcmp(argv[i], "--expect-guest") == 0) {
            expect_guest = 1;
        } else {
            path = argv[i];
        }
    }

    printf("{\"path\":");
    json_string(path);

    struct stat st;
    if (stat(path, &st) == 0)
        printf(",\"stat\":{\"mode\":%u,\"uid\":%u,\"gid\":%u,\"major\":%u,\"minor\":%u,\"chr\":%s}",
               (unsigned)(st.st_mode & 07777), (unsigned)st.st_uid, (unsigned)st.st_gid,
               major(st.st_rdev), minor(st.st_rdev), S_ISCHR(st.st_mode) ? "true" : "false");
    else
        printf(",\"stat\":null,\"stat_errno\":%d", errno);

    putchar(',');
    print_cgroup_rules();

    /* Without a guest run to its end, the status --expect-guest gives. */
    const int no_guest = expect_guest ? 3 : 0;
    if (drop) {
        /* order matters: groups and gid while still privileged, uid last */
        if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0) {
            printf(",\"drop_errno\":%d}\n", errno);
            return finish(do_hold, no_guest);
        }
    }
    putchar(',');
    print_ids();

    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        printf(",\"open_errno\":%d,\"api_version\":null,\"vm\":null}\n", errno);
        return finish(do_hold, no_guest);
    }
    int status = no_guest;
    int version = ioctl(fd, KVM_GET_API_VERSION, 0);
    if (version < 0) {
        printf(",\"open_errno\":0,\"api_version\":null,\"ioctl_errno\":%d,\"vm\":null}\n", errno);
    } else {
        printf(",\"open_errno\":0,\"api_version\":%d", version);
        if (print_guest_run(fd))
            status = 0;
        printf("}\n");
    }
    close(fd);
    return finish(do_hold, status);
}
