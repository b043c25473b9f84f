"""`preload bench attach | restart | decode | prefill | quant | replicas | rollback | spec`: each module has
add_arguments(parser) and run(args)."""
