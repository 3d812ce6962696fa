"""meshnet: one GGUF model run across several processes and hosts, a layer range each."""

__version__ = "0.1.0"
