"""gpupool wire protocol, sans-IO: bytes in, events out (see docs/PROTOCOL.md)."""
