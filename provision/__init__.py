"""gpuctl, laptop side: config, rendering, providers, remote execution, state."""

__version__ = "0.1.0"
