"""The pool's Redis and the job queue on it: keys, Lua scripts, enqueue to complete, reads, workers."""
