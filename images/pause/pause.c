/* The pod sandbox's process (containerd's sandbox_image): it holds a pod's namespaces open until the
 * runtime stops it. As PID 1 it gets no default signal handling, so SIGTERM and SIGINT are waited
 * for and end it with status 0; in a pod that shares its process namespace it also reaps orphans. */
#include <signal.h>
#include <stddef.h>
#include <sys/wait.h>

int main(void) {
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGTERM);
    sigaddset(&signals, SIGINT);
    sigaddset(&signals, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &signals, NULL) != 0) {
        return 1;
    }
    for (;;) {
        int received;
        if (sigwait(&signals, &received) != 0) {
            return 1;
        }
        if (received != SIGCHLD) {
            return 0;
        }
        while (waitpid(-1, NULL, WNOHANG) > 0) {
        }
    }
}
