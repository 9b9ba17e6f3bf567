/* _spawn: start a job's first process with vfork, switching its credentials in the child.

Why C: the launcher (launcher.py) starts every job, and a fork of even a small Python process
costs a job more than its whole exec (page tables copied, then copy-on-write faults for every
object the child's Python touches). vfork copies nothing, but the child shares the launcher's
memory until it execs, so it may only make system calls; CPython's subprocess therefore gives up
vfork when credentials change. Here the child makes exactly the calls a job's start needs, all
raw system calls (no glibc wrapper that would broadcast a uid change to other threads: the
launcher has none, and the child must change only itself), in this order:

    (cgroup)               born in the slot's cgroup (as root, before the switch: it cannot leave)
    signals                every disposition back to the default, then an empty mask
    setsid                 a session, and so a process group, of its own
    0, 1, 2                stdin, and stdout+stderr into the job's output pipe
    close_range(3, ~0)     nothing else of the launcher's: no job holds its socket
    setgroups, setresgid, setresuid   no supplementary groups, then all three gids and uids
    chdir(cwd)             as the job's uid: a directory it may not enter fails the start
    execve                 each candidate path in turn, as execvp does with PATH

A failure before the exec leaves its errno in a variable the parent shares, and the child exits;
the parent reaps it and raises OSError. The parent blocks every signal around the vfork, so no
handler of the launcher's ever runs on the child's side of the shared memory.

Into its cgroup: the vfork is clone3(CLONE_VM | CLONE_VFORK | CLONE_INTO_CGROUP) where the kernel
has it (Linux 5.7, x86-64 here), so the child is born in the slot's cgroup. Joining one after
birth (a write of 0 to its cgroup.procs, the fallback) takes the kernel's lock on every thread
group for writing, which waits for an RCU grace period: ~12 ms a job on an idle machine (cheap
only while jobs start back to back), most of an idle pool's submit-to-start. The child of a
clone3 that shares its parent's stack must not return into a frame the parent will use: glibc's
vfork keeps its return address in a register for that reason, and so does gp_clone3_vfork below.

kill_uid(uid, gid): a child (forked: a process of the uid may SIGSTOP it, which must not stop the
launcher; it is waited for SWEEP_MS at most, then killed) switches to `uid` and sends SIGKILL to
every process it may (kill(-1): all of the uid's, one pass over the kernel's task list, which no
fork in flight can escape), twice, then tells whether any task of the uid is still there.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define SWEEP_MS 100  /* the longest kill_uid waits for its sweeper */

#if defined(__x86_64__)
#define CLONE_INTO_CGROUP_FLAG 0x200000000ULL  /* <linux/sched.h>, Linux 5.7 */

/* struct clone_args of <linux/sched.h>, up to `cgroup` (CLONE_ARGS_SIZE_VER2) */
struct gp_clone_args {
    unsigned long long flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls,
        set_tid, set_tid_size, cgroup;
};

/* clone3(args, size) for a child that shares this stack (CLONE_VM | CLONE_VFORK, no stack of its
   own), as glibc's vfork is written: the return address is popped into a register the system
   call keeps (rdx), and pushed back after it, in the parent and in the child alike; so the child's
   calls cannot overwrite it for the parent. Returns the pid, 0 in the child, or -errno. */
long gp_clone3_vfork(struct gp_clone_args *args, unsigned long size);
__asm__(
    ".text\n"
    ".globl gp_clone3_vfork\n"
    ".hidden gp_clone3_vfork\n"
    ".type gp_clone3_vfork, @function\n"
    "gp_clone3_vfork:\n"
    "    popq %rdx\n"
    "    movl $435, %eax\n"  /* SYS_clone3 */
    "    syscall\n"
    "    pushq %rdx\n"
    "    ret\n"
    ".size gp_clone3_vfork, .-gp_clone3_vfork\n");
static int no_clone3;  /* set once the kernel said it has no clone3 (before Linux 5.3) */
#endif

struct plan {
    char **paths;  /* candidates for the program, NULL-terminated */
    char **argv;
    char **envp;
    const char *cwd;
    int stdin_fd, out_fd, cgroup_fd;  /* cgroup_fd: the cgroup's directory, or -1 */
    int born_in;  /* the child may be born in the cgroup (else, or where it cannot, it joins) */
    int join;  /* the child joins the cgroup first thing (cgroup.procs) */
    long uid, gid;  /* -1: keep the launcher's */
    volatile int error;  /* set by the child when it could not exec */
};

static void child_signals(void)
{
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; sig++) {
        if (sig != SIGKILL && sig != SIGSTOP)
            (void)sigaction(sig, &dfl, NULL);  /* EINVAL for glibc's own: left as they are */
    }
    sigset_t none;
    sigemptyset(&none);
    (void)syscall(SYS_rt_sigprocmask, SIG_SETMASK, &none, NULL, (size_t)(_NSIG / 8));
}

static pid_t wait_for(pid_t pid)
{
    int status;
    pid_t got;
    do
        got = waitpid(pid, &status, 0);
    while (got < 0 && errno == EINTR);
    return got;
}

/* A slot's ids: never root, never -1 (which setres*id reads as "keep"). */
static int valid_id(long id)
{
    return id > 0 && id < 0xFFFFFFFFL;
}

static int switch_to(long uid, long gid)
{
    if (syscall(SYS_setgroups, 0, NULL) != 0)
        return -1;
    if (syscall(SYS_setresgid, gid, gid, gid) != 0)
        return -1;
    if (syscall(SYS_setresuid, uid, uid, uid) != 0)
        return -1;
    /* Leaving root clears every capability, unless securebits said to keep them: make sure. */
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct none[2];
    memset(none, 0, sizeof none);
    return (int)syscall(SYS_capset, &header, none);
}

static void __attribute__((noreturn)) child(struct plan *p)
{
    int failure = 0;
    if (p->join) {
        int procs = openat(p->cgroup_fd, "cgroup.procs", O_WRONLY | O_CLOEXEC);
        if (procs < 0 || write(procs, "0", 1) != 1)
            goto fail;
        (void)close(procs);
    }
    child_signals();
    if (setsid() < 0)
        goto fail;
    if (dup2(p->stdin_fd, 0) < 0 || dup2(p->out_fd, 1) < 0 || dup2(p->out_fd, 2) < 0)
        goto fail;
#ifdef SYS_close_range
    (void)syscall(SYS_close_range, 3U, ~0U, 0U);  /* ENOSYS before Linux 5.9: all is close-on-exec */
#endif
    if (p->uid >= 0 && switch_to(p->uid, p->gid) != 0)
        goto fail;
    if (chdir(p->cwd) != 0)
        goto fail;
    for (char **path = p->paths; *path != NULL; path++) {
        execve(*path, p->argv, p->envp);
        if (errno == ENOENT || errno == ENOTDIR) {
            if (failure == 0)
                failure = errno;
        } else if (errno == EACCES) {
            failure = errno;  /* and go on looking, as execvp does */
        } else {
            failure = errno;
            break;
        }
    }
    p->error = failure ? failure : ENOENT;
    _exit(127);
fail:
    p->error = errno ? errno : EINVAL;
    _exit(127);
}

/* vfork in a function of its own, which the child never returns from: born in the cgroup where
   the kernel can (clone3), else joining it first thing. */
static pid_t __attribute__((noinline)) start(struct plan *p)
{
    p->join = p->cgroup_fd >= 0;
#if defined(__x86_64__)
    if (p->join && p->born_in && !no_clone3) {
        struct gp_clone_args args = {0};
        args.flags = CLONE_VM | CLONE_VFORK | CLONE_INTO_CGROUP_FLAG;
        args.exit_signal = SIGCHLD;
        args.cgroup = (unsigned long long)p->cgroup_fd;
        p->join = 0;
        long pid = gp_clone3_vfork(&args, sizeof args);
        if (pid == 0)
            child(p);
        if (pid > 0)
            return (pid_t)pid;
        if (pid != -ENOSYS && pid != -E2BIG && pid != -EINVAL && pid != -EOPNOTSUPP) {
            errno = (int)-pid;
            return -1;
        }
        no_clone3 = pid == -ENOSYS || pid == -E2BIG;  /* no clone3, or none that knows cgroups */
        p->join = 1;  /* EINVAL: no CLONE_INTO_CGROUP (before 5.7), or not a cgroup v2 directory */
    }
#endif
    pid_t pid = vfork();
    if (pid == 0)
        child(p);
    return pid;
}

static void __attribute__((noreturn)) sweeper(long uid, long gid)
{
    if (switch_to(uid, gid) != 0)
        _exit(2);
    (void)kill(-1, SIGKILL);
    (void)kill(-1, SIGKILL);
    /* Is any task of the uid left (dying, or a zombie not yet reaped)? The kernel counts a uid's
       tasks against RLIMIT_NPROC: with a limit of two, a child of this process can start only if
       it and this one are all the uid has. (kill(-1, 0) cannot tell: it succeeds whenever any
       other process exists, permitted or not.) */
    struct rlimit two = {2, 2};
    if (setrlimit(RLIMIT_NPROC, &two) != 0)
        _exit(2);
    pid_t probe = vfork();
    if (probe == 0)
        _exit(0);
    if (probe < 0)
        _exit(errno == EAGAIN ? 1 : 2);
    (void)wait_for(probe);
    _exit(0);
}

/* A forked child, not a vforked one: once it is the uid, any process of the uid may SIGSTOP it,
   and a vfork parent would wait for it for ever. The parent waits SWEEP_MS at most. */
static pid_t start_sweeper(long uid, long gid)
{
    pid_t pid = (pid_t)syscall(SYS_clone, (unsigned long)SIGCHLD, 0UL, 0UL, 0UL, 0UL);
    if (pid == 0)
        sweeper(uid, gid);
    return pid;
}

/* A NULL-terminated array of the bytes in `seq` (a list or tuple of bytes); NULL with an error set. */
static char **strings(PyObject *seq, const char *what)
{
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {  /* which hold their items while we borrow */
        PyErr_Format(PyExc_TypeError, "%s must be a list or tuple of bytes", what);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    char **out = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(item) || (size_t)PyBytes_GET_SIZE(item) != strlen(PyBytes_AS_STRING(item))) {
            PyErr_Format(PyExc_ValueError, "%s: every item must be bytes without a NUL", what);
            PyMem_Free(out);
            return NULL;
        }
        out[i] = PyBytes_AS_STRING(item);  /* borrowed: the caller's sequence holds the bytes */
    }
    return out;
}

PyDoc_STRVAR(spawn_doc,
"spawn(paths, argv, envp, cwd, stdin_fd, out_fd, uid, gid, cgroup_fd, born_in) -> pid\n\n"
"Start the first of `paths` that execs (bytes each; argv and envp lists of bytes, envp as\n"
"b'KEY=value') in `cwd`, in a session of its own, with stdin from `stdin_fd` and stdout and\n"
"stderr into `out_fd`, as `uid`/`gid` unless -1, in the cgroup whose directory is open as\n"
"`cgroup_fd` unless -1: born in it if `born_in` (where the kernel can), else joining it first\n"
"thing. Raises OSError (the child reaped) when it could not start.");

static PyObject *spawn(PyObject *self, PyObject *args)
{
    PyObject *paths_obj, *argv_obj, *envp_obj;
    const char *cwd;
    struct plan p = {0};
    if (!PyArg_ParseTuple(args, "OOOyiillip", &paths_obj, &argv_obj, &envp_obj, &cwd, &p.stdin_fd,
                          &p.out_fd, &p.uid, &p.gid, &p.cgroup_fd, &p.born_in))
        return NULL;
    if ((p.uid != -1 || p.gid != -1) && !(valid_id(p.uid) && valid_id(p.gid))) {
        PyErr_SetString(PyExc_ValueError, "spawn: a uid and gid, both above 0, or neither (-1)");
        return NULL;
    }
    p.cwd = cwd;
    PyObject *result = NULL;
    p.paths = strings(paths_obj, "paths");
    p.argv = p.paths ? strings(argv_obj, "argv") : NULL;
    p.envp = p.argv ? strings(envp_obj, "envp") : NULL;
    if (p.envp == NULL)
        goto done;
    if (p.paths[0] == NULL || p.argv[0] == NULL) {
        PyErr_SetString(PyExc_ValueError, "spawn needs a program and an argv");
        goto done;
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t pid = start(&p);
    int saved = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) {
        errno = saved;
        PyErr_SetFromErrno(PyExc_OSError);
    } else if (p.error != 0) {
        (void)wait_for(pid);
        errno = p.error;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        result = PyLong_FromLong((long)pid);
    }
done:
    PyMem_Free(p.paths);
    PyMem_Free(p.argv);
    PyMem_Free(p.envp);
    return result;
}

PyDoc_STRVAR(kill_uid_doc,
"kill_uid(uid, gid) -> bool\n\n"
"SIGKILL every process of `uid` (as that uid, so nothing else), in a child; returns once sent,\n"
"True when some process of the uid is still there (dying, or a zombie not yet reaped).");

static PyObject *kill_uid(PyObject *self, PyObject *args)
{
    long uid, gid;
    if (!PyArg_ParseTuple(args, "ll", &uid, &gid))
        return NULL;
    if (!valid_id(uid) || !valid_id(gid)) {  /* kill(-1) as root would end the machine */
        PyErr_SetString(PyExc_ValueError, "kill_uid needs a uid and a gid above 0");
        return NULL;
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t pid = start_sweeper(uid, gid);
    int saved = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) {
        errno = saved;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    int status = 0;
    pid_t got = 0;
#ifdef SYS_pidfd_open
    int exited = (int)syscall(SYS_pidfd_open, pid, 0);  /* readable once it has exited */
#else
    int exited = -1;
#endif
    if (exited >= 0) {
        struct pollfd ready = {exited, POLLIN, 0};
        int n;
        do
            n = poll(&ready, 1, SWEEP_MS);
        while (n < 0 && errno == EINTR);
        close(exited);
        do
            got = waitpid(pid, &status, WNOHANG);
        while (got < 0 && errno == EINTR);
    } else {  /* before Linux 5.3: look every 0.1 ms */
        for (int waited = 0; got == 0 && waited < SWEEP_MS * 10; waited++) {
            got = waitpid(pid, &status, WNOHANG);
            if (got == 0) {
                struct timespec tenth = {0, 100000};
                nanosleep(&tenth, NULL);
            } else if (got < 0 && errno == EINTR) {
                got = 0;
            }
        }
    }
    if (got == 0) {  /* stopped by a process of the uid, or stuck: as root, end it */
        (void)kill(pid, SIGKILL);
        (void)wait_for(pid);
        Py_RETURN_TRUE;  /* unknown: the caller looks again */
    }
    if (got < 0 || !WIFEXITED(status) || WEXITSTATUS(status) == 2) {
        PyErr_SetString(PyExc_OSError, "kill_uid: could not switch to the uid");
        return NULL;
    }
    return PyBool_FromLong(WEXITSTATUS(status) == 1);
}

static PyMethodDef methods[] = {
    {"spawn", spawn, METH_VARARGS, spawn_doc},
    {"kill_uid", kill_uid, METH_VARARGS, kill_uid_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_spawn", "Job processes started with vfork (see the source's head).", -1, methods,
};

PyMODINIT_FUNC PyInit__spawn(void)
{
    return PyModule_Create(&module);
}
