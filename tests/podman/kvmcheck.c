/*
 * kvmcheck: what a container process sees of a device node, printed as one JSON line.
 *
 *   kvmcheck [--as UID:GID] [PATH]        PATH defaults to /dev/kvm
 *
 * In order: stat PATH (as the container's first process sees it), read the container's cgroup v1
 * device rules if they are readable, drop to UID:GID (no supplementary groups) if asked, then open
 * PATH read-write and ask it KVM_GET_API_VERSION. Exit status 0 whenever the JSON line was printed;
 * the verdict is in the line, not in the status.
 *
 * Built with `gcc -static` so that an image holding only this file can run it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#define KVM_GET_API_VERSION 0xAE00 /* _IO(KVMIO, 0x00) */

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
        else if (c < 0x20)
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

int main(int argc, char **argv)
{
    const char *path = "/dev/kvm";
    int drop = 0;
    unsigned uid = 0, gid = 0;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--as") == 0 && i + 1 < argc) {
            if (sscanf(argv[++i], "%u:%u", &uid, &gid) != 2) {
                fprintf(stderr, "kvmcheck: --as wants UID:GID\n");
                return 2;
            }
            drop = 1;
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

    if (drop) {
        /* order matters: groups and gid while still privileged, uid last */
        if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0) {
            printf(",\"drop_errno\":%d}\n", errno);
            return 0;
        }
    }
    putchar(',');
    print_ids();

    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        printf(",\"open_errno\":%d,\"api_version\":null}\n", errno);
        return 0;
    }
    int version = ioctl(fd, KVM_GET_API_VERSION, 0);
    if (version < 0)
        printf(",\"open_errno\":0,\"api_version\":null,\"ioctl_errno\":%d}\n", errno);
    else
        printf(",\"open_errno\":0,\"api_version\":%d}\n", version);
    close(fd);
    return 0;
}
