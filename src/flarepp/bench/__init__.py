"""Benchmarks: one module per measurement, each a library function the CLI calls.

* :mod:`flarepp.bench.scaling`: time and memory of complete models against N (paper D.3,
  Figure 6), with achieved FLOP/s against the analytic count of :mod:`flarepp.bench.flops`;
* :mod:`flarepp.bench.cp`: context-parallel scaling (Table 5) and streaming memory;
* :mod:`flarepp.bench.streaming`: block-wise streaming inference against the unchunked
  forward (time, peak memory, exactness) and on meshes too large for it;
* :mod:`flarepp.bench.memory`: the peak-memory probes they share.

Modules are imported on use; importing this package loads none of them.
"""
