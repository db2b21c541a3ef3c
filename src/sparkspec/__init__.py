"""sparkspec: provisioning and deployment toolkit for DGX Spark + vLLM speculative decoding."""

__version__ = "0.2.0"
