"""The one C module, which pyproject.toml cannot yet declare but as an experiment: the job
launcher's vfork with a credential switch (daemon/worker/_spawn.c says why neither Python nor
CPython's subprocess can do it as cheaply). Linux only, like the worker. Everything else about the
package is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "daemon.worker._spawn",
            sources=["daemon/worker/_spawn.c"],
            extra_compile_args=["-O2", "-Wall", "-Werror"],
            # every symbol bound at load: the child calls no library function (the test reads the
            # built module), and if one slipped in, it would find its address already bound rather
            # than in the dynamic linker, which is not safe in a thread's memory
            extra_link_args=["-Wl,-z,now"],
        )
    ]
)
