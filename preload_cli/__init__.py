"""The `preload` command line: the top layer, above worker/ (the engine) and preload_daemon/ (the
weight-cache daemon). Also home to the benchmarks (preload_cli.bench), the demo and the model
builders used by the tests and benchmarks."""
