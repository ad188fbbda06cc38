"""Benchmarks of shardtrain.format (run each as `python -m benchmarks.format.NAME`)."""
