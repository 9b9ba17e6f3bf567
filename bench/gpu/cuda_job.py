"""A job on a shared GPU, with the CUDA driver alone (ctypes): which GPU it sees, then hold
`size` bytes on it for `hold` seconds."""

import ctypes
import sys
import time

want, size, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
cuda = ctypes.CDLL("libcuda.so.1")


def ok(r: int, what: str) -> None:
    if r != 0:
        print(f"{what}: CUDA error {r}", flush=True)
        sys.exit(1)


ok(cuda.cuInit(0), "cuInit")
n = ctypes.c_int()
ok(cuda.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
print(f"sees {n.value} device(s)", flush=True)
if n.value == 0 or size == 0:
    sys.exit(0)
dev = ctypes.c_int()
ok(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
raw = (ctypes.c_ubyte * 16)()
ok(cuda.cuDeviceGetUuid(raw, dev), "cuDeviceGetUuid")
h = bytes(raw).hex()
uuid = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
print(f"device 0 is {uuid}; asked for {want}: {'same' if uuid == want else 'DIFFERENT'}", flush=True)
ctx = ctypes.c_void_p()
ok(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
ptr = ctypes.c_uint64()
ok(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc")
print(f"allocated {size / 2**30:.0f} GiB", flush=True)
time.sleep(hold)
