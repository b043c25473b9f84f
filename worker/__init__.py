"""The disposable engine worker: model, generation engine, HTTP server and loaders."""
