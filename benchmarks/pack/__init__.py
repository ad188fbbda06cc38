"""Benchmarks of shardtrain.pack (run each as `python -m benchmarks.pack.NAME`)."""
