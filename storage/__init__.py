"""gpupool object storage: S3/MinIO and a local directory behind one small interface."""
