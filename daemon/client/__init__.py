"""The client of the pool server, shared by poolctl (ctl/) and a worker that speaks to the pool
through its server: where to connect, TLS and its pin, the async `PoolClient`."""
