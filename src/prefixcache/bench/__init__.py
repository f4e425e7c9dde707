"""Benchmarks behind ``prefixcache bench``: manager overhead, offline throughput, serving, traces."""
