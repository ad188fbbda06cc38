"""Benchmarks of shardtrain.interop (run each as `python -m benchmarks.interop.NAME`)."""
