"""Benchmarks of shardtrain.load (run each as `python -m benchmarks.load.NAME`)."""
