"""gpupool daemon: everything with a socket or a process (server, worker, queue, CLI)."""
