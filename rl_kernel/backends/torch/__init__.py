"""The torch backend: strict kernels from single IEEE operations, on CPU and CUDA alike."""
