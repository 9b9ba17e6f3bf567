"""poolctl: the command line, its client of the pool server, rendering and data transfers."""
