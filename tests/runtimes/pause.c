/*
 * pause: the pod sandbox's process, as the CRI runtime starts it from `sandbox_image`.
 *
 * It holds the pod's namespaces and does nothing else: reaps any child it inherits, and exits 0 on
 * SIGTERM or SIGINT (as PID 1 of its PID namespace it must catch them, or they are ignored).
 * Built with `gcc -static`, so the image holds this one file.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stddef.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig)
{
    (void)sig;
    _exit(0);
}

static void on_child(int sig)
{
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0)
        ;
}

int main(void)
{
    struct sigaction stop = {.sa_handler = on_stop};
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    sigaction(SIGTERM, &stop, NULL);
    sigaction(SIGINT, &stop, NULL);
    sigaction(SIGCHLD, &child, NULL);
    for (;;)
        pause();
}
