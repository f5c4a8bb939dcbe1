"""Clustered parallel split learning (GCPSL) on unbroken's public API: data, non-IID
partition, clusters, global sampling, the split model, the training methods, and the
cluster-worker job that runs under `unbroken run`."""
