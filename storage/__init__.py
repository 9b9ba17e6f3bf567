"""gpupool object storage: S3/MinIO and a local directory behind one small interface.

`ObjectStore` (storage.base) is the interface; `S3Store` (storage.s3) and `LocalStore`
(storage.local) implement it; `ObjectCache` (storage.cache) is the workers' content-addressed
cache; storage.content packs directories into deterministic tar streams and unpacks them safely.
"""

from storage.base import (
    BucketUnavailable,
    ChecksumMismatch,
    InvalidKey,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    TransferFailed,
)

__all__ = [
    "BucketUnavailable",
    "ChecksumMismatch",
    "InvalidKey",
    "ObjectExists",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "StorageError",
    "TransferFailed",
]
