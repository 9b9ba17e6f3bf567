"""The one C module, which pyproject.toml cannot yet declare but as an experiment: the job
launcher's vfork with a credential switch (daemon/worker/_spawn.c says why neither Python nor
CPython's subprocess can do it as cheaply). Linux only, like the worker. Everything else about the
package is in pyproject.toml.

It is built only where a worker can run it: on Linux, unless GPUPOOL_NO_WORKER_MODULE=1 is set.
Elsewhere (a laptop with macOS), and with that variable (a Linux laptop without a C compiler, or a
pure wheel to hand to such laptops), the package is pure Python: poolctl never imports the module,
and a worker started without it refuses with a sentence (daemon/worker/native.py). A platform check,
not an optional build (`Extension(optional=True)`): on a worker's machine a module that fails to
compile must fail the install, where it is seen, not make a worker that refuses at its start."""

import os
import sys

from setuptools import Extension, setup

WORKER_MODULE = Extension(
    "daemon.worker._spawn",
    sources=["daemon/worker/_spawn.c"],
    extra_compile_args=["-O2", "-Wall", "-Werror"],
    # every symbol bound at load: the child calls no library function (the test reads the
    # built module), and if one slipped in, it would find its address already bound rather
    # than in the dynamic linker, which is not safe in a thread's memory
    extra_link_args=["-Wl,-z,now"],
)

without = os.environ.get("GPUPOOL_NO_WORKER_MODULE", "") not in ("", "0")
setup(ext_modules=[WORKER_MODULE] if sys.platform == "linux" and not without else [])
