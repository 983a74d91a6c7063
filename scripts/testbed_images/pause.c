/*
 * pause: PID 1 of the test bed's pod sandboxes.
 *
 * Exits 0 on SIGTERM or SIGINT, reaps children on SIGCHLD and otherwise
 * sleeps in pause() forever. PID 1 gets no default signal dispositions,
 * so the handlers are what makes StopPodSandbox return promptly.
 *
 * Build: gcc -O2 -static -o pause pause.c
 */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig)
{
    (void)sig;
    _exit(0);
}

static void on_chld(int sig)
{
    int saved = errno;

    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0)
        ;
    errno = saved;
}

int main(void)
{
    struct sigaction sa;

    memset(&sa, 0, sizeof(sa));
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    sa.sa_handler = on_chld;
    sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigaction(SIGCHLD, &sa, NULL);

    for (;;)
        pause();
    return 0;
}
