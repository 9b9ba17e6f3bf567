/* _spawn: start a job's first process from the worker's own event loop, without waiting for it.

Why C, and why in the worker: every pool job is a process, and how fast a worker turns queued
commands into processes is what its users feel. Python cannot start a process cheaply with another
uid: a fork copies the worker's page tables (hundreds of MB), and CPython's subprocess, which
vforks, gives that up as soon as credentials change. A helper process that vforked for the worker
(this module's first use) cost every job four messages between two processes, each waking the
other on a machine where waking is what costs most. So the worker starts its jobs itself, the way
posix_spawn does: the child shares the worker's memory (CLONE_VM, nothing copied) on a stack of
its own, inside one mapping that also holds its argv, environment and plan, and makes only system
calls until it execs. Unlike posix_spawn, the worker does not wait for that exec (x86-64): a chdir
or an exec that hangs in a dead network filesystem holds up that job, never the event loop, which
heartbeats for every job of the worker. Elsewhere the child is a CLONE_VFORK one, and the calling
thread waits for its exec, as CPython's own subprocess does.

The kernel answers a pidfd (CLONE_PIDFD). The loop watches it: it becomes readable when the job's
first process has ended, and `reap` collects it with one waitid. Nothing waits for a SIGCHLD: the
exit signal is 0 at the clone, but the kernel makes it SIGCHLD again at the exec (a process that
changed its program reports its end as any child does). The worker has no handler for it; uvloop
has one while a child of its own lives (the orphan guard), which then wakes the loop once more at
each job's end, and reaps only its own children.

The child, in this order (raw system calls on x86-64: it must not set errno, which is the worker
thread's own while their memory is shared):

    (cgroup)                   born in the slot's cgroup (CLONE_INTO_CGROUP), or joining it first
    (joins)                    the slot's cgroup v1 directories joined (its CPU and memory limits)
    signals                    every disposition back to the default, then an empty mask
    setsid                     a session, and so a process group, of its own
    (nice)                     nicer than the worker: the pool's own work is never starved by jobs
    0, 1, 2                    stdin, and stdout+stderr into the job's output pipe (an exec's
                               stderr into a pipe of its own; a tty job's three are its terminal)
    (ctty) TIOCSCTTY           a tty job's terminal (fd 0) made its session's controlling one:
                               Ctrl-C, Ctrl-Z and window changes reach its foreground group
    close_range(3, ~0)         nothing else of the worker's
    (with a uid) namespaces    IPC, network (loopback up), mounts hiding GPUs not given: as asked
                 keyrings      a new session keyring joined
                 the switch    no_new_privs, no bounding or ambient capabilities, no supplementary
                               groups, all three gids, all three uids, no capability left
                 keyrings      the uid's persistent keyring emptied first, then its user and
                               user-session keyrings emptied and locked (k_empty_user_keyrings);
                               not for an exec in a running job (err_fd given): they are its job's
    chdir(cwd)                 as the job's uid: a directory it may not enter fails the start
    execve                     each candidate path in turn, as execvp does with PATH

It cannot be stopped in between by a signal meant for the worker: the worker's thread blocks every
signal around the clone, so the child starts with all of them blocked and unblocks them only
once every handler is back to the default. Once it has the slot's uid it still shares the worker's
memory until its exec; the kernel makes a process whose uid changed non-dumpable, so no process of
that uid may ptrace it or read its memory meanwhile.

When it cannot start, it writes the errno to its plan (and which step failed) and exits 127;
`reap` answers that errno and step with the status, and the worker tells the job's owner why (a
program exiting 127 of itself has started: its errno is 0). A mapping is free again once its
child has exec'd or exited (CLONE_CHILD_CLEARTID: the kernel zeroes a word in it at either), or,
for a child that could not start, once `reap` has read why; a few free ones are kept for the next
children.

sweep(uid, gid): a child, born as above, that switches to `uid` and sends SIGKILL to every process
it may (kill(-1): all of the uid's, one pass over the kernel's task list, which no fork in flight
can escape), twice, then exits 0 (2: it could not switch). A process of the uid may SIGSTOP it: the
worker waits for it a moment at most, then kills it, and never waits for it otherwise.
*/

#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <linux/capability.h>
#include <linux/keyctl.h>
#include <net/if.h>
#include <sys/ioctl.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/msg.h>
#include <sys/sem.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif
#ifndef P_PIDFD
#define P_PIDFD 3
#endif
#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif
#define GP_CLONE_INTO_CGROUP 0x200000000ULL /* <linux/sched.h>, Linux 5.7 */
#define STACK_BYTES (64 * 1024)             /* the child's stack, at the top of its mapping */
#define CHILD_STATUS 127                    /* a child that could not start exits with this */
#define NO_NICE (-100)                      /* keep the worker's niceness */

#define MAX_JOINS 4 /* cgroup v1 hierarchies a job joins: memory, cpu, cpuacct */

/* One child's mapping: this header, its plan's arrays and strings, then its stack. */
struct birth {
    struct birth *next; /* births whose mapping is still held */
    size_t size;        /* of the mapping */
    pid_t pid;
    volatile uint32_t alive; /* CLONE_CHILD_CLEARTID: zeroed by the kernel at the exec or the exit */
    volatile int error;      /* why it could not start (0: it did, or has not got that far) */
    char **paths; /* candidates for the program, NULL-terminated */
    char **argv;
    char **envp;
    const char *cwd;
    int stdin_fd, out_fd, err_fd, cgroup_fd; /* cgroup_fd: the cgroup's directory, or -1 */
    int join;                         /* the child joins the cgroup first thing (cgroup.procs) */
    int joins[MAX_JOINS];             /* more cgroup directories it joins then (cgroup v1's) */
    int join_count;
    int nice;                         /* its niceness; NO_NICE: the worker's */
    long uid, gid;                    /* -1: keep the worker's */
    char **hidden;                    /* device nodes it may not open, NULL-terminated (with a uid) */
    int own_ipc, own_net;             /* an IPC, a network namespace of its own (with a uid) */
    int in_job;                       /* a command in a running job: its uid's keyrings are the job's */
    int ctty;                         /* its stdin is a terminal to make its controlling one */
    int net_fd, ipc_fd;               /* (in a job) its job's network, IPC namespaces to join, or -1 */
    const char *volatile step;        /* what it was doing when it failed (NULL: its exec) */
    int caller_waits;                 /* the calling thread waits for its exec (CLONE_VFORK) */
};

/* The GIL guards both lists: every function here holds it. */
static struct birth *births; /* mappings children may still need */
static struct birth *spares; /* mappings no child needs, kept for the next ones (SPARES at most) */
static int spare_count;
#define SPARES 16 /* a worker's slots' worth: reused, a mapping costs no mmap, munmap or page fault */

/* -- the system calls the child makes ------------------------------------------------------- */

#if defined(__x86_64__)
/* Raw: the result or -errno, and errno untouched (the child shares it with a running thread). */
static inline long k_call(long n, long a, long b, long c, long d, long e)
{
    long ret;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8)
                     : "rcx", "r11", "memory");
    return ret;
}

static void k_default_signals(void)
{
    struct { /* the kernel's struct sigaction on x86-64 */
        void *handler;
        unsigned long flags;
        void *restorer;
        unsigned long mask;
    } dfl = {SIG_DFL, 0, NULL, 0};
    for (long sig = 1; sig <= 64; sig++) {
        if (sig != SIGKILL && sig != SIGSTOP)
            (void)k_call(SYS_rt_sigaction, sig, (long)&dfl, 0, 8, 0);
    }
    unsigned long none = 0;
    (void)k_call(SYS_rt_sigprocmask, SIG_SETMASK, (long)&none, 0, 8, 0);
}

/* clone3(args, size) for a child on a stack of its own that runs fn(arg) and exits with what it
   returns (as glibc's clone does): rdx and r8 survive the system call, so the child finds fn and
   arg there. Returns the pid in the parent, or -errno. */
struct gp_clone_args { /* struct clone_args of <linux/sched.h>, up to `cgroup` */
    unsigned long long flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls,
        set_tid, set_tid_size, cgroup;
};
long gp_clone3(struct gp_clone_args *args, unsigned long size, int (*fn)(void *), void *arg);
__asm__(".text\n"
        ".globl gp_clone3\n"
        ".hidden gp_clone3\n"
        ".type gp_clone3, @function\n"
        "gp_clone3:\n"
        "    movq %rcx, %r8\n"
        "    movl $435, %eax\n" /* SYS_clone3 */
        "    syscall\n"
        "    testq %rax, %rax\n"
        "    jz 1f\n"
        "    ret\n"
        "1:  xorl %ebp, %ebp\n"
        "    movq %r8, %rdi\n"
        "    call *%rdx\n"
        "    movl %eax, %edi\n"
        "    movl $231, %eax\n" /* exit_group */
        "    syscall\n"
        "    hlt\n"
        ".size gp_clone3, .-gp_clone3\n");
static int no_clone3; /* the kernel has none (before Linux 5.3), or a seccomp filter refuses it */
#else
/* Through glibc: the calling thread waits for the child (CLONE_VFORK), so errno is not shared. */
static long k_call(long n, long a, long b, long c, long d, long e)
{
    long ret = syscall(n, a, b, c, d, e);
    return ret == -1 ? -errno : ret;
}

static void k_default_signals(void)
{
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; sig++) {
        if (sig != SIGKILL && sig != SIGSTOP)
            (void)sigaction(sig, &dfl, NULL); /* EINVAL for glibc's own: left as they are */
    }
    sigset_t none;
    sigemptyset(&none);
    (void)k_call(SYS_rt_sigprocmask, SIG_SETMASK, (long)&none, 0, sizeof(long), 0);
}
#endif

static long k_dup_onto(int fd, int target)
{
    if (fd == target) /* keep it, but across the exec */
        return k_call(SYS_fcntl, fd, F_SETFD, 0, 0, 0);
    return k_call(SYS_dup3, fd, target, 0, 0, 0);
}

static long k_join_cgroup(int cgroup_fd)
{
    long procs = k_call(SYS_openat, cgroup_fd, (long)"cgroup.procs", O_WRONLY | O_CLOEXEC, 0, 0);
    if (procs < 0)
        return procs;
    long wrote = k_call(SYS_write, procs, (long)"0", 1, 0, 0);
    (void)k_call(SYS_close, procs, 0, 0, 0, 0);
    return wrote < 0 ? wrote : 0;
}

/* All three gids and uids (nothing can switch back), no supplementary groups. */
static long k_switch_to(long uid, long gid)
{
    long r;
    if ((r = k_call(SYS_setgroups, 0, 0, 0, 0, 0)) < 0)
        return r;
    if ((r = k_call(SYS_setresgid, gid, gid, gid, 0, 0)) < 0)
        return r;
    return k_call(SYS_setresuid, uid, uid, uid, 0, 0);
}

/* No privileges to gain on exec (setuid programs, file capabilities), no capability to keep. */
static long k_give_up_privileges(void)
{
    long r;
    if ((r = k_call(SYS_prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) < 0)
        return r;
    for (long cap = 0; k_call(SYS_prctl, PR_CAPBSET_DROP, cap, 0, 0, 0) == 0; cap++)
        ; /* EINVAL past the last capability */
    (void)k_call(SYS_prctl, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    return 0;
}

static long k_no_capabilities(void)
{
    /* Leaving root clears the permitted and effective sets, unless securebits said to keep them,
       and never the inheritable one: all three emptied. */
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct none[2];
    memset(none, 0, sizeof none);
    return k_call(SYS_capset, (long)&header, (long)none, 0, 0, 0);
}

/* What a job reaches of its machine beyond what it was given (root, before the switch): namespaces
   of its own, so that nothing of another job's, or of the previous job's of its uid, is in reach.
   - IPC: System V objects and POSIX message queues are per IPC namespace; a job's go with it.
   - mounts: a copy of the worker's, a slave of them (the machine's new mounts reach the job, the
     job's never reach the machine), in which each GPU device node it was not given is bound onto
     itself and remounted nodev: it is there, and opening it fails with EACCES. The job has no
     capability to undo it, and in a user namespace of its own the kernel locks both the bind
     and its nodev (a mount inherited from a more privileged namespace).
   - network: only a loopback of its own, brought up here (the job may not), and no route out:
     another job's loopback ports and abstract unix sockets are in another namespace. */
static long k_own_namespaces(struct birth *b)
{
    long r;
    long flags = (b->own_ipc ? CLONE_NEWIPC : 0) | (b->own_net ? CLONE_NEWNET : 0) |
                 (b->hidden != NULL && b->hidden[0] != NULL ? CLONE_NEWNS : 0);
    if (flags == 0)
        return 0;
    b->step = "making namespaces of its own";
    if ((r = k_call(SYS_unshare, flags, 0, 0, 0, 0)) < 0)
        return r;
    if (flags & CLONE_NEWNS) {
        b->step = "making its mounts a slave of the machine's";
        if ((r = k_call(SYS_mount, (long)"none", (long)"/", 0, MS_REC | MS_SLAVE, 0)) < 0)
            return r;
        b->step = "hiding a GPU it was not given";
        for (char **node = b->hidden; *node != NULL; node++) {
            if ((r = k_call(SYS_mount, (long)*node, (long)*node, 0, MS_BIND, 0)) < 0 ||
                (r = k_call(SYS_mount, 0, (long)*node, 0,
                            MS_BIND | MS_REMOUNT | MS_NODEV | MS_NOSUID | MS_NOEXEC | MS_RDONLY, 0)) < 0)
                return r;
        }
    }
    if (flags & CLONE_NEWNET) {
        b->step = "bringing up its loopback";
        struct ifreq lo;
        memset(&lo, 0, sizeof lo);
        memcpy(lo.ifr_name, "lo", 3);
        long sock = k_call(SYS_socket, AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0, 0, 0);
        if (sock < 0)
            return sock;
        if ((r = k_call(SYS_ioctl, sock, SIOCGIFFLAGS, (long)&lo, 0, 0)) == 0) {
            lo.ifr_flags |= IFF_UP;
            r = k_call(SYS_ioctl, sock, SIOCSIFFLAGS, (long)&lo, 0, 0);
        }
        (void)k_call(SYS_close, sock, 0, 0, 0, 0);
        if (r < 0)
            return r;
    }
    b->step = NULL;
    return 0;
}

/* The kernel's keyrings outlive processes: a uid's user keyrings (@u, @us) and persistent one hold
   what the previous job of the uid, another user's perhaps, put there, and the worker's session
   keyring would be the job's too. Before the switch, the job joins a new, empty session keyring
   (made as root: it counts against no quota the previous job could have filled; the job possesses
   it, which gives it every right on it); after it, as the uid, it empties the uid's keyrings. A
   kernel without keyrings (ENOSYS) or without persistent ones (EOPNOTSUPP) has nothing to leak. */
static long k_new_session_keyring(void)
{
    long r = k_call(SYS_keyctl, KEYCTL_JOIN_SESSION_KEYRING, 0, 0, 0, 0);
    return r == -ENOSYS ? 0 : r;
}

/* A uid's user and user-session keyrings outlive its processes: the kernel keeps them for the uid
   until the machine restarts. Each start empties them and leaves them so that the uid (their owner,
   and their possessor through KEY_SPEC_USER_KEYRING and the like) may only view and read them:
   - no WRITE: a job cannot put a key there for the next job of its uid;
   - no SETATTR: it cannot give itself that right back, nor expire the keyring;
   - no SEARCH: it cannot invalidate the keyring, after which the kernel would give the uid a new
     one, writable and the job's to lock again with a key in it (the way round a lock that kept
     SEARCH, which a reviewer showed);
   - no LINK: it has nothing to link it into.
   The kernel finds a uid's keyring by searching for it, so once it may not be searched,
   KEY_SPEC_USER_KEYRING answers ENOKEY to every process of the uid, and the kernel never makes the
   uid another (it finds this one, and refuses). The next start, which has no more rights than the
   job (it is the uid by then, with no capability), meets that ENOKEY too; it takes the keyring as
   locked only when /proc/keys, which lists the keys the uid may view, shows it with exactly these
   permissions and empty. A job can make keyrings of those names too, and keep them past its end
   (in its uid's persistent keyring, or another uid's that its user's job on another slot links
   them into): the kernel gives a uid's own keyrings no group, so /proc/keys shows one made by a
   process of the uid by its group, the job's, and the start never takes such a one for an open
   keyring of the uid's (one that looks locked is harmless: at worst the start goes on while the
   kernel still makes the uid a new keyring, empty, which the next start empties and locks).
   ENOKEY is also what the uid gets for a moment after its keyring was invalidated, until the
   kernel's garbage collector has taken it: the start then waits for the new one, a millisecond at
   a time (KEYRING_WAITS). One the uid may search but not write (locked
   by an earlier version of this module, which kept SEARCH, or by a job) is invalidated, and the
   kernel's new one emptied and locked. (An earlier version meets a keyring so locked with ENOKEY
   and fails the start: going back to one needs the machine restarted.) */
#define KEYRING_PERM 0x03030000 /* KEY_POS_{VIEW,READ}, KEY_USR_ the same */
#define KEYRING_PERM_TEXT "03030000" /* as /proc/keys shows it */
/* How long a start waits for the kernel's new keyring, in milliseconds. The kernel makes it once an
   RCU grace period has passed, which a busy machine makes longer: the bound leaves room for the
   slowest. Where the calling thread waits for the child's exec (CLONE_VFORK), so do the
   worker's event loop and every job's heartbeat: a fifth of a second at most then. */
#define KEYRING_WAITS 5000
#define KEYRING_WAITS_BLOCKING 200

/* strlen and memcmp, as the child may call no library function (the first call of one goes
   through the dynamic linker, which is not safe in a process sharing a thread's memory). Read
   through a volatile pointer: GCC makes a plain loop of this kind a call to strlen. */
static long k_length(const char *text)
{
    const volatile char *at = text;
    long n = 0;
    while (at[n] != '\0')
        n++;
    return n;
}

static int k_same(const char *a, const char *b, long n)
{
    for (long i = 0; i < n; i++) {
        if (a[i] != b[i])
            return 0;
    }
    return 1;
}

/* Whether the line `line` (`len` bytes) of /proc/keys, "serial flags usage timeout perm uid gid type
   description: summary" split at spaces, is the keyring `name``uid` of uid `uid` (text); *locked
   then tells whether it has KEYRING_PERM and no link, *made_by_uid whether its group is `gid`'s (a
   keyring a process of the uid made: the kernel's own have none). */
static int k_is_keyring(const char *line, long len, const char *name, const char *uid, const char *gid,
                        int *locked, int *made_by_uid)
{
    const char *field[10];
    long lengths[10], n = 0;
    for (long i = 0; i < len && n < 10;) {
        while (i < len && line[i] == ' ')
            i++;
        long from = i;
        while (i < len && line[i] != ' ')
            i++;
        if (i > from) {
            field[n] = line + from;
            lengths[n++] = i - from;
        }
    }
    long name_len = k_length(name), uid_len = k_length(uid), gid_len = k_length(gid);
    if (n < 10 || lengths[7] != 7 || !k_same(field[7], "keyring", 7) ||
        lengths[8] != name_len + uid_len + 1 || !k_same(field[8], name, name_len) ||
        !k_same(field[8] + name_len, uid, uid_len) || field[8][name_len + uid_len] != ':' ||
        lengths[5] != uid_len || !k_same(field[5], uid, uid_len))
        return 0;
    *locked = lengths[4] == 8 && k_same(field[4], KEYRING_PERM_TEXT, 8) && lengths[9] == 5 &&
              k_same(field[9], "empty", 5);
    *made_by_uid = lengths[6] == gid_len && k_same(field[6], gid, gid_len);
    return 1;
}

/* What /proc/keys shows of the keyrings named `name``uid` of uid `uid`: KEYRING_FOUND when it lists
   one, KEYRING_OPEN when one of them is not locked (as k_empty_user_keyrings leaves it) and not
   made by a process of the uid (in group `gid`); -errno. */
#define KEYRING_FOUND 1
#define KEYRING_OPEN 2
static long k_keyrings_listed(const char *name, const char *uid, const char *gid)
{
    char text[4096];
    long kept = 0, seen = 0;
    long fd = k_call(SYS_openat, AT_FDCWD, (long)"/proc/keys", O_RDONLY | O_CLOEXEC, 0, 0);
    if (fd < 0)
        return fd;
    for (;;) {
        long n = k_call(SYS_read, fd, (long)(text + kept), (long)sizeof text - kept, 0, 0);
        if (n < 0) {
            (void)k_call(SYS_close, fd, 0, 0, 0, 0);
            return n;
        }
        long end = kept + n, from = 0;
        for (long i = 0; i < end; i++) {
            if (text[i] != '\n')
                continue;
            int locked = 0, made_by_uid = 0;
            if (k_is_keyring(text + from, i - from, name, uid, gid, &locked, &made_by_uid) &&
                (locked || !made_by_uid))
                seen |= KEYRING_FOUND | (locked ? 0 : KEYRING_OPEN);
            from = i + 1;
        }
        if (n == 0 || (from == 0 && end == (long)sizeof text)) /* the end, or a line too long */
            break;
        volatile char *to = text; /* volatile: a loop the compiler cannot make a call to memmove */
        for (kept = 0; from + kept < end; kept++)
            to[kept] = text[from + kept];
    }
    (void)k_call(SYS_close, fd, 0, 0, 0, 0);
    return seen;
}

/* `uid` in decimal into `at` (32 bytes), NUL-terminated. */
static void k_decimal(long uid, char *at)
{
    char digits[24];
    int n = 0;
    do
        digits[n++] = (char)('0' + uid % 10);
    while ((uid /= 10) > 0);
    while (n > 0)
        *at++ = digits[--n];
    *at = '\0';
}

/* Empty the uid's persistent keyring. It is writable by whoever links it in (and no one may change
   its attributes), so it is emptied at every start, and first: what the last job left there is
   gone before the start looks at the uid's other keyrings. A job that revoked it leaves the next
   one a new one. */
static long k_empty_persistent_keyring(void)
{
    long r, persistent = k_call(SYS_keyctl, KEYCTL_GET_PERSISTENT, -1, KEY_SPEC_SESSION_KEYRING, 0, 0);
    if (persistent == -EOPNOTSUPP || persistent == -ENOSYS)
        return 0;
    if (persistent < 0)
        return persistent;
    if ((r = k_call(SYS_keyctl, KEYCTL_CLEAR, persistent, 0, 0, 0)) < 0)
        return r;
    return k_call(SYS_keyctl, KEYCTL_UNLINK, persistent, KEY_SPEC_SESSION_KEYRING, 0, 0);
}

/* Empty the uid's user-session keyring, then its user keyring, and lock them, by serial: the kernel
   finds either through the user keyring, so from the first lock on neither can be named. */
static long k_empty_user_keyrings(struct birth *b)
{
    const struct timespec millisecond = {0, 1000000};
    char uid[32], gid[32];
    k_decimal(b->uid, uid);
    k_decimal(b->gid, gid);
    for (long waited = 0;;) {
        long r, keyrings[2];
        keyrings[0] = r = k_call(SYS_keyctl, KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_SESSION_KEYRING, 1, 0, 0);
        if (r >= 0)
            keyrings[1] = r = k_call(SYS_keyctl, KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING, 1, 0, 0);
        if (r == -ENOSYS)
            return 0;
        if (r == -ENOKEY || r == -EKEYREVOKED || r == -EKEYEXPIRED) {
            /* locked by an earlier start, or one being collected: the user keyring must be listed
               and locked, and a user-session keyring, if there is one, locked (there is none when
               the user keyring was locked first: the kernel never gets as far as making it) */
            long user = k_keyrings_listed("_uid.", uid, gid);
            long session = k_keyrings_listed("_uid_ses.", uid, gid);
            if (user < 0 || session < 0)
                return user < 0 ? user : session;
            if (user == KEYRING_FOUND && !(session & KEYRING_OPEN))
                break;
            if (waited++ == (b->caller_waits ? KEYRING_WAITS_BLOCKING : KEYRING_WAITS)) {
                b->step = "emptying its uid's keyrings: one is neither locked as a start leaves it nor replaced";
                return r;
            }
            (void)k_call(SYS_nanosleep, (long)&millisecond, 0, 0, 0, 0);
            continue;
        }
        if (r < 0)
            return r;
        long replaced = 0;
        r = 0;
        for (int i = 0; i < 2 && r == 0; i++) {
            r = k_call(SYS_keyctl, KEYCTL_CLEAR, keyrings[i], 0, 0, 0);
            if (r == -EACCES) { /* searchable, not writable: not as a start leaves it, so replaced */
                b->step = "replacing its uid's keyrings";
                r = k_call(SYS_keyctl, KEYCTL_INVALIDATE, keyrings[i], 0, 0, 0);
                replaced = 1;
            }
        }
        if (r < 0)
            return r;
        b->step = "emptying its uid's keyrings";
        if (replaced)
            continue; /* for the kernel's new ones */
        b->step = "locking its uid's keyrings";
        if ((r = k_call(SYS_keyctl, KEYCTL_SETPERM, keyrings[0], KEYRING_PERM, 0, 0)) < 0 ||
            (r = k_call(SYS_keyctl, KEYCTL_SETPERM, keyrings[1], KEYRING_PERM, 0, 0)) < 0)
            return r;
        break;
    }
    return 0;
}

/* -- the children --------------------------------------------------------------------------- */

static void __attribute__((noreturn)) fail(struct birth *b, long r)
{
    b->error = r < 0 ? (int)-r : EINVAL;
    (void)k_call(SYS_exit_group, CHILD_STATUS, 0, 0, 0, 0);
    __builtin_unreachable();
}

static int job_child(void *arg)
{
    struct birth *b = arg;
    long r;
    if (b->join && (r = k_join_cgroup(b->cgroup_fd)) < 0)
        fail(b, r);
    for (int i = 0; i < b->join_count; i++) {
        if ((r = k_join_cgroup(b->joins[i])) < 0)
            fail(b, r);
    }
    k_default_signals();
    if ((r = k_call(SYS_setsid, 0, 0, 0, 0, 0)) < 0)
        fail(b, r);
    if (b->nice != NO_NICE && (r = k_call(SYS_setpriority, PRIO_PROCESS, 0, b->nice, 0, 0)) < 0)
        fail(b, r);
    if ((r = k_dup_onto(b->stdin_fd, 0)) < 0 || (r = k_dup_onto(b->out_fd, 1)) < 0 ||
        (r = k_dup_onto(b->err_fd, 2)) < 0)
        fail(b, r);
    b->step = "taking its terminal";
    if (b->ctty && (r = k_call(SYS_ioctl, 0, TIOCSCTTY, 0, 0, 0)) < 0)
        fail(b, r);
    b->step = "joining its job's namespaces"; /* before their descriptors are closed */
    if ((b->net_fd >= 0 && (r = k_call(SYS_setns, b->net_fd, CLONE_NEWNET, 0, 0, 0)) < 0) ||
        (b->ipc_fd >= 0 && (r = k_call(SYS_setns, b->ipc_fd, CLONE_NEWIPC, 0, 0, 0)) < 0))
        fail(b, r);
    b->step = NULL;
#ifdef SYS_close_range
    (void)k_call(SYS_close_range, 3, ~0U, 0, 0, 0); /* ENOSYS before 5.9: all is close-on-exec */
#endif
    if (b->uid >= 0) {
        if ((r = k_own_namespaces(b)) < 0)
            fail(b, r);
        b->step = "joining a session keyring of its own";
        if ((r = k_new_session_keyring()) < 0)
            fail(b, r);
        b->step = "switching to its uid";
        if ((r = k_give_up_privileges()) < 0 || (r = k_switch_to(b->uid, b->gid)) < 0 ||
            (r = k_no_capabilities()) < 0)
            fail(b, r);
        /* A command run inside a running job (an exec) leaves its uid's keyrings alone: they are
           the running job's, emptied at its own start. */
        b->step = "emptying its uid's persistent keyring";
        if (!b->in_job && (r = k_empty_persistent_keyring()) < 0)
            fail(b, r);
        b->step = "emptying its uid's keyrings";
        if (!b->in_job && (r = k_empty_user_keyrings(b)) < 0)
            fail(b, r);
        b->step = NULL;
    }
    if ((r = k_call(SYS_chdir, (long)b->cwd, 0, 0, 0, 0)) < 0)
        fail(b, r);
    long failure = 0;
    for (char **path = b->paths; *path != NULL; path++) {
        r = k_call(SYS_execve, (long)*path, (long)b->argv, (long)b->envp, 0, 0);
        if (r == -ENOENT || r == -ENOTDIR) {
            if (failure == 0)
                failure = r;
        } else if (r == -EACCES) {
            failure = r; /* and go on looking, as execvp does */
        } else {
            failure = r;
            break;
        }
    }
    fail(b, failure ? failure : -ENOENT);
}

static int sweeper_child(void *arg)
{
    struct birth *b = arg;
    k_default_signals();
    if (k_switch_to(b->uid, b->gid) < 0)
        return 2;
    (void)k_call(SYS_kill, -1, SIGKILL, 0, 0, 0);
    (void)k_call(SYS_kill, -1, SIGKILL, 0, 0, 0); /* one pass reaches all; a fork racing it fails */
    return 0;
}

/* -- births ----------------------------------------------------------------------------------- */

/* A mapping no child needs any more: kept for the next one, or unmapped. */
static void retire(struct birth *b)
{
    if (spare_count < SPARES) {
        b->next = spares;
        spares = b;
        spare_count++;
    } else {
        munmap(b, b->size);
    }
}

/* Retire what no child needs any more: exec'd, or exited with nothing left to tell. */
static void collect(void)
{
    for (struct birth **at = &births; *at != NULL;) {
        struct birth *b = *at;
        if (b->alive == 0 && b->error == 0) {
            *at = b->next;
            retire(b);
        } else {
            at = &b->next;
        }
    }
}

/* The error of `pid`'s child (0 if it started), and the step it failed at in *step (NULL: its
   exec, or it started), its mapping unmapped. */
static int forget(pid_t pid, const char **step)
{
    *step = NULL;
    for (struct birth **at = &births; *at != NULL; at = &(*at)->next) {
        struct birth *b = *at;
        if (b->pid == pid) {
            int error = b->error;
            *step = b->step; /* a string of this module's: it outlives the mapping */
            *at = b->next;
            retire(b);
            return error;
        }
    }
    return 0; /* exec'd, and collected since */
}

/* A mapping for a child (a spare one if one is large enough): the header, `extra` bytes after
   it, the stack at the top. */
static struct birth *new_birth(size_t extra)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t size = (sizeof(struct birth) + extra + STACK_BYTES + page - 1) / page * page;
    struct birth *b = NULL;
    for (struct birth **at = &spares; *at != NULL; at = &(*at)->next) {
        if ((*at)->size >= size) {
            b = *at;
            *at = b->next;
            spare_count--;
            size = b->size;
            break;
        }
    }
    if (b == NULL) {
        void *at = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
        if (at == MAP_FAILED) {
            PyErr_SetFromErrno(PyExc_OSError);
            return NULL;
        }
        b = at;
    }
    memset(b, 0, sizeof *b);
    b->size = size;
    b->alive = 1;
    b->stdin_fd = b->out_fd = b->err_fd = b->cgroup_fd = b->net_fd = b->ipc_fd = -1;
    b->nice = NO_NICE;
    b->uid = b->gid = -1;
    return b;
}

/* Start `fn` on `b`; its pid, with its pidfd in *pidfd (-1 where the kernel has none: before
   Linux 5.2). -1 with an exception set when it could not be started. `born_in`: in b's cgroup. */
static pid_t start(struct birth *b, int (*fn)(void *), int born_in, int *pidfd)
{
    long pid;
    sigset_t all, old;
    sigfillset(&all);
    *pidfd = -1;
    b->join = b->cgroup_fd >= 0 && !born_in;
    pthread_sigmask(SIG_SETMASK, &all, &old);
#if defined(__x86_64__)
    if (!no_clone3) {
        struct gp_clone_args args;
        memset(&args, 0, sizeof args);
        args.flags = CLONE_VM | CLONE_PIDFD | CLONE_CHILD_CLEARTID;
        args.pidfd = (unsigned long long)(uintptr_t)pidfd;
        args.child_tid = (unsigned long long)(uintptr_t)&b->alive;
        args.stack = (unsigned long long)(uintptr_t)b;
        args.stack_size = b->size;
        if (b->cgroup_fd >= 0 && born_in) {
            args.flags |= GP_CLONE_INTO_CGROUP;
            args.cgroup = (unsigned long long)b->cgroup_fd;
        }
        pid = gp_clone3(&args, sizeof args, fn, b);
        if (pid == -EINVAL && (args.flags & GP_CLONE_INTO_CGROUP)) {
            /* no CLONE_INTO_CGROUP (before 5.7), or not a cgroup v2 directory: join it instead */
            b->join = 1;
            args.flags &= ~GP_CLONE_INTO_CGROUP;
            args.cgroup = 0;
            pid = gp_clone3(&args, sizeof args, fn, b);
        }
        no_clone3 = pid == -ENOSYS || pid == -E2BIG;
        if (pid >= 0 || !no_clone3) {
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            if (pid < 0) {
                errno = (int)-pid;
                PyErr_SetFromErrno(PyExc_OSError);
                return -1;
            }
            return (pid_t)pid;
        }
    }
#endif
    /* glibc's clone: the child on its own stack, this thread waiting until it has exec'd */
    int flags = CLONE_VM | CLONE_VFORK | CLONE_CHILD_CLEARTID;
    b->join = b->cgroup_fd >= 0;
    b->caller_waits = 1;
    pid_t *cleared = (pid_t *)&b->alive;
    pid = clone(fn, (char *)b + b->size, flags | CLONE_PIDFD, b, pidfd, NULL, cleared);
    if (pid < 0 && errno == EINVAL) { /* no CLONE_PIDFD (before Linux 5.2) */
        *pidfd = -1;
        pid = clone(fn, (char *)b + b->size, flags, b, NULL, NULL, cleared);
    }
    int saved = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) {
        errno = saved;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return (pid_t)pid;
}

/* Start `fn` on `b` and keep `b` among the births: (pid, pidfd), or NULL with an exception set. */
static PyObject *give_birth(struct birth *b, int (*fn)(void *), int born_in)
{
    int pidfd;
    pid_t pid = start(b, fn, born_in, &pidfd);
    if (pid < 0) {
        retire(b);
        return NULL;
    }
    b->pid = pid;
    b->next = births;
    births = b;
    return Py_BuildValue("(ii)", (int)pid, pidfd);
}

/* A slot's id: never root, never -1 (which setres*id reads as "keep"). */
static int valid_id(long id)
{
    return id > 0 && id < 0xFFFFFFFFL;
}

/* -- the module's functions ------------------------------------------------------------------ */

/* Bytes in `seq` (a list or tuple of bytes without NUL), copied into `*at` and listed in `out`
   (NULL-terminated). With `out` NULL, only counts: returns the bytes it needs, or -1 with an
   exception set. */
static Py_ssize_t copy_strings(PyObject *seq, const char *what, char ***out, char **at)
{
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of bytes", what);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), need = (n + 1) * (Py_ssize_t)sizeof(char *);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(item) || (size_t)PyBytes_GET_SIZE(item) != strlen(PyBytes_AS_STRING(item))) {
            PyErr_Format(PyExc_ValueError, "%s: every item must be bytes without a NUL", what);
            return -1;
        }
        Py_ssize_t len = PyBytes_GET_SIZE(item) + 1;
        need += len;
        if (out != NULL) {
            memcpy(*at, PyBytes_AS_STRING(item), (size_t)len);
            (*out)[i] = *at;
            *at += len;
        }
    }
    if (out != NULL)
        (*out)[n] = NULL;
    return need;
}

static char **take_array(char **at, PyObject *seq)
{
    char **array = (char **)*at;
    *at += (PySequence_Fast_GET_SIZE(seq) + 1) * sizeof(char *);
    return array;
}

PyDoc_STRVAR(spawn_doc,
"spawn(paths, argv, envp, cwd, stdin_fd, out_fd, uid, gid, cgroup_fd, born_in, nice, hidden, own_ipc,\n"
"      own_net, err_fd=-1, net_fd=-1, ipc_fd=-1, ctty=False) -> (pid, pidfd)\n\n"
"Start the first of `paths` that execs (bytes each; argv and envp lists of bytes, envp as\n"
"b'KEY=value') in `cwd`, in a session of its own, with stdin from `stdin_fd` and stdout and\n"
"stderr into `out_fd` (stderr into `err_fd` instead unless -1), as `uid`/`gid` unless -1 (then without privileges to gain), in the cgroup\n"
"whose directory is open as `cgroup_fd` unless -1: born in it if `born_in` (where the kernel\n"
"can), else joining it first thing, at niceness `nice` unless -100 (the caller's). With a uid:\n"
"a session keyring of its own, the uid's keyrings emptied, an IPC namespace of its own if\n"
"`own_ipc`, a network namespace with only its loopback if `own_net`, and the device nodes\n"
"`hidden` (paths, bytes) made unopenable in a mount namespace of its own. Returns at once\n"
"(x86-64); whether it could start, `reap` tells. pidfd is -1 on a kernel without pidfds.\n"
"Raises OSError when no process could be made. `net_fd`, `ipc_fd` unless -1: namespaces it joins\n"
"first (a running job's, for a command run in it; then pass own_net and own_ipc false). `ctty`:\n"
"`stdin_fd` is a terminal, made the child's controlling terminal (TIOCSCTTY) after its setsid.\n"
"`joins`: up to 4 more cgroup directories (open fds, cgroup v1's) it joins first thing.");

static PyObject *spawn(PyObject *self, PyObject *args)
{
    PyObject *paths_obj, *argv_obj, *envp_obj;
    const char *cwd;
    Py_ssize_t cwd_len;
    PyObject *hidden_obj;
    int stdin_fd, out_fd, cgroup_fd, born_in, nice, own_ipc, own_net, err_fd = -1, net_fd = -1, ipc_fd = -1;
    int ctty = 0;
    long uid, gid;
    PyObject *joins_obj = NULL;
    if (!PyArg_ParseTuple(args, "OOOy#iillipiOpp|iiipO", &paths_obj, &argv_obj, &envp_obj, &cwd, &cwd_len,
                          &stdin_fd, &out_fd, &uid, &gid, &cgroup_fd, &born_in, &nice, &hidden_obj, &own_ipc,
                          &own_net, &err_fd, &net_fd, &ipc_fd, &ctty, &joins_obj))
        return NULL;
    int joins[MAX_JOINS], join_count = 0;
    if (joins_obj != NULL) {
        if (!PyTuple_Check(joins_obj) || PyTuple_GET_SIZE(joins_obj) > MAX_JOINS) {
            PyErr_SetString(PyExc_ValueError, "spawn: joins, a tuple of at most 4 directory fds");
            return NULL;
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(joins_obj); i++) {
            long fd = PyLong_AsLong(PyTuple_GET_ITEM(joins_obj, i));
            if (fd < 0 || fd > INT_MAX) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "spawn: joins, directory fds");
                return NULL;
            }
            joins[join_count++] = (int)fd;
        }
    }
    if (nice != NO_NICE && (nice < -20 || nice > 19)) {
        PyErr_SetString(PyExc_ValueError, "spawn: a niceness from -20 to 19, or -100 (the caller's)");
        return NULL;
    }
    if ((uid != -1 || gid != -1) && !(valid_id(uid) && valid_id(gid))) {
        PyErr_SetString(PyExc_ValueError, "spawn: a uid and gid, both above 0, or neither (-1)");
        return NULL;
    }
    if ((size_t)cwd_len != strlen(cwd)) {
        PyErr_SetString(PyExc_ValueError, "cwd: bytes without a NUL");
        return NULL;
    }
    Py_ssize_t sizes[4];
    PyObject *seqs[4] = {paths_obj, argv_obj, envp_obj, hidden_obj};
    const char *names[4] = {"paths", "argv", "envp", "hidden"};
    for (int i = 0; i < 4; i++) {
        if ((sizes[i] = copy_strings(seqs[i], names[i], NULL, NULL)) < 0)
            return NULL;
    }
    if (uid == -1 && (own_ipc || own_net || PySequence_Fast_GET_SIZE(hidden_obj) != 0)) {
        PyErr_SetString(PyExc_ValueError, "spawn: namespaces and hidden nodes need a uid (root undoes them)");
        return NULL;
    }
    if (PySequence_Fast_GET_SIZE(paths_obj) == 0 || PySequence_Fast_GET_SIZE(argv_obj) == 0) {
        PyErr_SetString(PyExc_ValueError, "spawn needs a program and an argv");
        return NULL;
    }
    collect();
    struct birth *b = new_birth((size_t)(sizes[0] + sizes[1] + sizes[2] + sizes[3] + cwd_len + 1));
    if (b == NULL)
        return NULL;
    char *at = (char *)(b + 1);
    char **arrays[4];
    for (int i = 0; i < 4; i++)
        arrays[i] = take_array(&at, seqs[i]);
    for (int i = 0; i < 4; i++)
        (void)copy_strings(seqs[i], names[i], &arrays[i], &at);
    memcpy(at, cwd, (size_t)cwd_len + 1);
    b->paths = arrays[0];
    b->argv = arrays[1];
    b->envp = arrays[2];
    b->hidden = arrays[3];
    b->own_ipc = own_ipc;
    b->own_net = own_net;
    b->cwd = at;
    b->stdin_fd = stdin_fd;
    b->out_fd = out_fd;
    b->err_fd = err_fd >= 0 ? err_fd : out_fd;
    b->in_job = err_fd >= 0; /* only an exec in a job has a stderr of its own */
    b->ctty = ctty;
    b->net_fd = net_fd;
    b->ipc_fd = ipc_fd;
    b->cgroup_fd = cgroup_fd;
    for (int i = 0; i < join_count; i++)
        b->joins[i] = joins[i];
    b->join_count = join_count;
    b->uid = uid;
    b->gid = gid;
    b->nice = nice;
    return give_birth(b, job_child, born_in);
}

PyDoc_STRVAR(sweep_doc,
"sweep(uid, gid) -> (pid, pidfd)\n\n"
"Start a child that, as `uid`, sends SIGKILL to every process of the uid (so nothing else),\n"
"twice. `reap` it: status 0 once sent, 2 when it could not switch to the uid.");

static PyObject *sweep(PyObject *self, PyObject *args)
{
    long uid, gid;
    if (!PyArg_ParseTuple(args, "ll", &uid, &gid))
        return NULL;
    if (!valid_id(uid) || !valid_id(gid)) { /* kill(-1) as root would end the machine */
        PyErr_SetString(PyExc_ValueError, "sweep needs a uid and a gid above 0");
        return NULL;
    }
    collect();
    struct birth *b = new_birth(0);
    if (b == NULL)
        return NULL;
    b->uid = uid;
    b->gid = gid;
    return give_birth(b, sweeper_child, 0);
}

PyDoc_STRVAR(reap_doc,
"reap(pid, pidfd, block=False) -> (status, error, step) | None\n\n"
"Collect a child of `spawn` or `sweep` that has ended: its status as subprocess gives it (-N:\n"
"killed by signal N), the errno that kept it from starting its program (0 when it did), and\n"
"what it was doing then (None: looking for its program, or it started).\n"
"None while it runs. `pidfd` -1: by pid. With `block`, wait for it (the GIL released).");

static PyObject *reap(PyObject *self, PyObject *args)
{
    int pid, pidfd, block = 0;
    if (!PyArg_ParseTuple(args, "ii|p", &pid, &pidfd, &block))
        return NULL;
    siginfo_t info;
    memset(&info, 0, sizeof info);
    int options = WEXITED | __WALL | (block ? 0 : WNOHANG);
    idtype_t idtype = pidfd >= 0 ? (idtype_t)P_PIDFD : P_PID;
    id_t id = pidfd >= 0 ? (id_t)pidfd : (id_t)pid;
    int r;
    if (block) {
        Py_BEGIN_ALLOW_THREADS
        do
            r = waitid(idtype, id, &info, options);
        while (r < 0 && errno == EINTR);
        Py_END_ALLOW_THREADS
    } else {
        do
            r = waitid(idtype, id, &info, options);
        while (r < 0 && errno == EINTR);
    }
    if (r < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (info.si_pid == 0)
        Py_RETURN_NONE;
    int status = info.si_code == CLD_EXITED ? info.si_status : -info.si_status;
    const char *step;
    int error = forget((pid_t)pid, &step);
    if (status != CHILD_STATUS || error == 0)
        return Py_BuildValue("(iiz)", status, 0, NULL);
    return Py_BuildValue("(iiz)", status, error, step);
}

PyDoc_STRVAR(sysv_objects_doc,
"sysv_objects() -> bool\n\n"
"Whether the machine has any System V shared memory segment, semaphore set or message queue\n"
"(or cannot tell): three system calls, far cheaper than reading /proc/sysvipc.");

static PyObject *sysv_objects(PyObject *self, PyObject *unused)
{
    struct shm_info shm;
    struct seminfo sem;
    struct msginfo msg;
    /* shm_info.used_ids, seminfo.semusz (sets in use), msginfo.msgpool (queues in use) */
    if (shmctl(0, SHM_INFO, (struct shmid_ds *)&shm) < 0 || shm.used_ids > 0)
        Py_RETURN_TRUE;
    union semun { int val; struct semid_ds *buf; unsigned short *array; struct seminfo *__buf; } arg;
    arg.__buf = &sem;
    if (semctl(0, 0, SEM_INFO, arg) < 0 || sem.semusz > 0)
        Py_RETURN_TRUE;
    if (msgctl(0, MSG_INFO, (struct msqid_ds *)&msg) < 0 || msg.msgpool > 0)
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyMethodDef methods[] = {
    {"spawn", spawn, METH_VARARGS, spawn_doc},
    {"sysv_objects", sysv_objects, METH_NOARGS, sysv_objects_doc},
    {"sweep", sweep, METH_VARARGS, sweep_doc},
    {"reap", reap, METH_VARARGS, reap_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_spawn", "Jobs' processes, started without a copy (see the source's head).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__spawn(void)
{
    return PyModule_Create(&module);
}
