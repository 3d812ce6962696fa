"""The engine in this process: the cffi binding of libmeshnet_engine, the GGUF layout, the
model registry, batching and the in-process pipeline. Imports core only."""
