"""`preload bench attach | restart | decode | quant`: each module has add_arguments(parser) and run(args)."""
