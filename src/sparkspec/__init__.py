"""sparkspec: provisioning and deployment toolkit for DGX Spark + vLLM speculative decoding."""

__version__ = "0.1.0"
