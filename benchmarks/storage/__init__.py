"""Benchmarks of shardtrain.storage (run each as `python -m benchmarks.storage.NAME`)."""
