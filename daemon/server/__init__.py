"""Server mode: the client listener, sessions, request handlers, the data desk and the reaper."""
